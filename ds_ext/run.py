"""``python -m ds_ext.run SCRIPT [ARGS...]``: run an unmodified DeepSpeed script with ds_ext.

Activates ds_ext (:func:`ds_ext.patch_deepspeed`: a ``deepspeed.initialize`` whose config
holds a ``"ds_ext"`` block goes through ``ds_ext.initialize``), runs SCRIPT as
``__main__`` with ARGS, and at exit prints on rank 0 the per-level traffic table of the
ledger. It works wherever a launcher can run a module or a Python file:

    deepspeed --num_gpus 8 --module ds_ext.run train.py --deepspeed_config cfg.json
    srun python -m ds_ext.run pretrain_gpt.py ...
    torchrun --nproc_per_node 8 -m ds_ext.run train.py ...
    ds-ext run train.py ...

If the script's ``--deepspeed_config`` enables ``ds_ext.ted``, its
``deepspeed.moe.layer.MoE`` layers are TEDMoE. ``-m MODULE`` runs a module instead of a file. Options the ``deepspeed`` launcher puts
before the script (``--local_rank=N``) are handed to the script, where a plain launch
would have put them.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import runpy
import sys

from ds_ext.errors import DsExtError

USAGE = "usage: python -m ds_ext.run SCRIPT [ARGS...]  |  python -m ds_ext.run -m MODULE [ARGS...]"


class ScriptError(DsExtError, ValueError):
    """No script or module to run, or one that does not exist."""


def _split(argv: list[str]) -> tuple[list[str], str, bool, list[str]]:
    """(launcher options, script or module, is_module, script args)."""
    lead = []
    args = list(argv)
    if args and args[0] == "--":
        args.pop(0)
    while args and args[0].startswith("--local_rank"):
        lead.append(args.pop(0))
        if lead[-1] == "--local_rank" and args:
            lead.append(args.pop(0))
    if not args:
        raise ScriptError(f"no script given; {USAGE}")
    if args[0] in ("-h", "--help"):
        print(f"{USAGE}\n\n" + __doc__.replace("``", ""))
        raise SystemExit(0)
    if args[0] == "-m":
        if len(args) < 2:
            raise ScriptError(f"-m needs a module name; {USAGE}")
        return lead, args[1], True, args[2:]
    return lead, args[0], False, args[1:]


def _check_target(target: str, is_module: bool) -> None:
    """Refuse a script file or module that does not exist (before anything is activated)."""
    if not is_module and not os.path.isfile(target):
        raise ScriptError(f"script {target!r} does not exist")
    if is_module:
        try:
            found = importlib.util.find_spec(target) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            raise ScriptError(f"module {target!r} not found")


def _exit_report() -> None:
    from ds_ext.runtime import latest

    runtime = latest()
    if runtime is None or runtime.job.rank != 0 or not runtime.ledger.steps:
        return
    print(f"\nds_ext: per-level traffic of this rank (ledger of {runtime.topology.name})", flush=True)
    print(runtime.report(), flush=True)


def main(argv: list[str] | None = None) -> None:
    lead, target, is_module, rest = _split(sys.argv[1:] if argv is None else argv)
    _check_target(target, is_module)
    import ds_ext

    sys.argv = [target, *lead, *rest]
    ds_ext.patch_deepspeed()  # reads the script's --deepspeed_config (TEDMoE substitution)
    atexit.register(_exit_report)
    if is_module:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
        runpy.run_path(target, run_name="__main__")


def run_process(argv: list[str] | None = None) -> None:
    """:func:`main` as a process's entry point: after a clean run (a return or exit status 0),
    the process groups the script left are destroyed while Python still runs.

    torch asks every job to; a gloo worker thread that outlives the interpreter's teardown can
    abort it ("terminate called without an active exception", pytorch#190489). Not after a
    failure: destroying groups whose peers still wait in a collective can hang (torchtitan#1342).
    """
    try:
        main(argv)
    except SystemExit as done:
        if done.code not in (None, 0):
            raise
        _destroy_process_groups()
        raise
    _destroy_process_groups()


def _destroy_process_groups() -> None:
    dist = sys.modules.get("torch.distributed")  # a script that never imported it has none (nor --help)
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    try:
        run_process()
    except DsExtError as err:
        print(f"ds_ext.run: error: {err}", file=sys.stderr)
        sys.exit(2)
