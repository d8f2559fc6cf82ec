"""What --use_tensorboard DIR and --use_wandb add: what common.Logger logs (the metrics, an RL eval's sample table)
also goes to TensorBoard and/or Weights & Biases. common.Logger imports this module only where one of those flags is
given; importing it only defines things."""

import html

from common import fail


class Trackers:
    """The run's TensorBoard writer and/or wandb run, on rank 0."""

    def __init__(self, args):
        self.tb = self.wandb = None
        if args.use_tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                fail("--use_tensorboard needs the tensorboard package: pip install tensorboard")
            self.tb = SummaryWriter(args.use_tensorboard)
        if args.use_wandb:
            try:
                import wandb
            except ImportError:
                fail("--use_wandb needs the wandb package: pip install wandb")
            self.wandb = wandb.init(project=args.wandb_project, name=args.wandb_run_name, config=vars(args))

    def log(self, step, metrics, prefix):
        for k, v in metrics.items():
            if self.tb:
                self.tb.add_scalar(f"{prefix}/{k}", v, step)
        if self.wandb:
            self.wandb.log({f"{prefix}/{k}": v for k, v in metrics.items()}, step=step)

    def log_samples(self, step, rows, texts, prefix):
        """The rows in full (texts: their values as text): TensorBoard's text `{prefix}/samples`, a markdown table, and
        a wandb Table."""
        if self.tb:  # escaped: markdown would take <|im_start|> for an HTML tag and | for a cell's end
            cells = [list(rows[0]), ["---"] * len(rows[0]),
                     *([html.escape(t).replace("|", "&#124;").replace("\n", "<br>") for t in row] for row in texts)]
            self.tb.add_text(f"{prefix}/samples", "\n".join(f"| {' | '.join(line)} |" for line in cells), step)
        if self.wandb:
            import wandb
            self.wandb.log({f"{prefix}/samples": wandb.Table(columns=list(rows[0]),
                                                             data=[list(r.values()) for r in rows])}, step=step)

    def close(self):
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.finish()
