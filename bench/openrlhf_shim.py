"""Run OpenRLHF's serve_rm on a CPU machine, for the benchmark only. Its modules import flash_attn (GPU
only) at load time for code the server never runs (packing, ring attention); this gives them a stub
package whose every attribute is a function that raises if called. Arguments pass through."""
import importlib.abc
import importlib.machinery
import runpy
import sys
import types


class StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)

        def unavailable(*args, **kwargs):
            raise RuntimeError(f"{self.__name__}.{name} is a benchmark stub (no flash-attn on CPU)")
        return unavailable


class StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name == "flash_attn" or name.startswith("flash_attn."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return StubModule(spec.name)

    def exec_module(self, module):
        module.__path__ = []


sys.meta_path.insert(0, StubFinder())
sys.argv = ["openrlhf.cli.serve_rm"] + sys.argv[1:]
runpy.run_module("openrlhf.cli.serve_rm", run_name="__main__")
