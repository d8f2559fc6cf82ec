"""The toy world's tool task (toy_agent.py's), as an agent written against the OpenAI chat API (a template for your
own): the prompt "07+x=" hides its second operand, which only this environment knows (the record's label). The reply
"?" asks for it, and the environment answers with the plain sum to solve ("\\n07+45="); any other reply is an answer,
reward 1 if it is the sum, else 0.

    python grpo.py --pretrain runs/sft_tool --agent_server toy_chat_agent.py \\
        --tokenizer_chat_template toy_world/plain_chat.jinja --label_key label \\
        --dataset toy_world/tool_train.jsonl --eval_dataset toy_world/tool_test.jsonl
    python agent_server.py runs/sft_tool --agent toy_chat_agent.py --tokenizer_chat_template \\
        toy_world/plain_chat.jinja --dataset toy_world/tool_test.jsonl --label_key label
                                                                # the same file, run against a saved policy

toy_world/plain_chat.jinja writes the turns' contents one after another, each reply closed by EOS: what the toy policy
was trained on (runs/sft_tool), so each episode is the one toy_agent.py gives, one sample, token for token. `rollout`
gets an openai.AsyncOpenAI client for the trainer's endpoint (the model is named "policy") and the dataset record
(every field the file has, with "prompt" and "label" added); it returns the reward, or a dict with "reward" and other
numbers to log (means).
"""


async def rollout(client, record):
    a, b = record["prompt"].split("+")[0][-2:], record["label"]  # "07" of "07+x="; the hidden operand
    messages = [{"role": "user", "content": record["prompt"]}]
    reply = (await client.chat.completions.create(model="policy", messages=messages)).choices[0].message.content
    asked = reply.strip() == "?"
    if asked:  # the tool call: the environment reveals the operand, the policy answers
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"\n{a}+{b}="}]
        reply = (await client.chat.completions.create(model="policy", messages=messages)).choices[0].message.content
    correct = float(reply.strip() == str(int(a) + int(b)))
    return {"reward": correct, "asked": float(asked), "accuracy": correct}
