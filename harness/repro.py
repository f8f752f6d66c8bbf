'''Standalone reproduction scripts: ``repro_script(finding) -> str``.

The script needs only torch and deepspeed.  It judges the finding's check with the code explore judged
it with: it embeds, verbatim, every zerostate module that run and that judgement need, loaded under
their own names by a small import hook (`EMBEDDED`, with everything they import in turn):

* ``executor`` -- runs the scenario as the worker does: ``net`` (the network, the DeepSpeed config,
  the training loop, the PyTorch oracle: one module per job), the ``tracer`` (events, through ``compat``, the era table
  and the one ``Patcher``) and the teardown between engines;
* ``run_checks`` -- `failed_checks`, the judgement of `DeepSpeedTarget.run`: the exception's check, the
  oracle, every spec of ``zerostate.specs`` (the monitors themselves) and ``model-agreement``
  (``agreement.compare`` against the model design's trace, computed at generation time and embedded
  as data);
* ``cross_rank_checks`` -- at world size 2 (``torchrun``) the ranks gather their results and judge
  ``ranks-trace`` / ``ranks-params`` / ``ranks-outcome`` as the rank pool does.

plus the scenario as JSON, the check id and the finding's origin or violation code.  ``hang``: no exit
within the timeout (``faulthandler`` dumps the stacks, exit 1); ``crash``: the process dies.

Run on CPU with ``python repro_N.py`` (it sets ``DS_ACCELERATOR=cpu``, gloo, ``MASTER_ADDR`` ...
itself when there is no GPU) or on GPUs with ``deepspeed --num_gpus 1 repro_N.py``.  Exit status:
1 while the finding's check fails, 0 once it holds (other checks that fail are listed, not counted);
2 when the run raised before the check could be judged, or this script cannot judge the check.
'''

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zerostate.findings.finding import Finding


ROOTS = ("zerostate.jit_ops", "zerostate.harness.executor", "zerostate.harness.net.dist", "zerostate.model.scenario",
         "zerostate.findings.decide", "zerostate.harness.cross_rank_checks")
"""The modules a repro script runs; every zerostate module they import is embedded with them."""

def _module_file(name: str) -> Path:
    file = importlib.import_module(name).__file__
    assert file is not None, f"{name} has no source file"
    return Path(file)


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False


def _is_package(name: str) -> bool:
    spec = importlib.util.find_spec(name)
    return spec is not None and spec.submodule_search_locations is not None


def _imports_of(name: str) -> set[str]:
    """The zerostate modules ``name`` imports, at module level or inside functions (by its syntax tree).
    ``from . import compat`` imports the submodule, not the package's ``__init__``."""
    package = name if _is_package(name) else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(_module_file(name).read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                full = base + ("." + node.module if node.module else "")
            else:
                full = node.module or ""
            if full != "zerostate" and not full.startswith("zerostate."):
                continue
            subs = [f"{full}.{a.name}" for a in node.names]
            if _is_package(full) and all(_is_module(sub) for sub in subs):
                out.update(subs)
            else:
                out.add(full)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name == "zerostate" or a.name.startswith("zerostate."))
    return out


def embedded_modules(roots: tuple[str, ...] = ROOTS) -> dict[str, tuple[bool, str]]:
    """module name -> (is a package, its source), for ``roots`` and every zerostate module they import,
    dependencies first.  A package nothing imports names from (``zerostate``, ``zerostate.targets`` ...) is
    not embedded: the script gives it an empty module, so its ``__init__`` (the CLI's imports) never runs."""
    order: list[str] = []

    def visit(name: str) -> None:
        if name in order:
            return
        order.append(name)  # placed now (an import cycle ends here), moved after its dependencies below
        for dep in sorted(_imports_of(name) - {name}):
            visit(dep)
        order.remove(name)
        order.append(name)
    for root in roots:
        visit(root)
    return {n: (_is_package(n), _module_file(n).read_text()) for n in order}


def _literal(source: str) -> str:
    """``source`` as a raw triple-quoted literal (verbatim, readable); repr() when that cannot hold it."""
    quote = "'" * 3
    if quote not in source and not source.endswith("\\"):
        return "r" + quote + source + quote
    return repr(source)


def _embedded_text() -> str:
    """The embedded modules' block of a script.  Built once per process and kept while none of its files has
    changed on disk (finding each module's imports parses every source: too slow to repeat per finding)."""
    kept = _EMBEDDED.get("block")
    if kept is not None and _stamps(kept[0]) == kept[1]:
        return kept[2]
    modules = embedded_modules()
    files = tuple(str(_module_file(name)) for name in modules)
    text = _embedded_block(modules)
    _EMBEDDED["block"] = (files, _stamps(files), text)
    return text


_EMBEDDED: dict[str, tuple[tuple[str, ...], tuple[tuple[int, int], ...], str]] = {}
"""``block``: the embedded files, their (mtime, size) when it was built, and the block."""


def _stamps(files: tuple[str, ...]) -> tuple[tuple[int, int], ...]:
    out = []
    for f in files:
        try:
            st = os.stat(f)
        except OSError:
            return ()
        out.append((st.st_mtime_ns, st.st_size))
    return tuple(out)


def _embedded_block(modules: dict[str, tuple[bool, str]]) -> str:
    parts = ["\n# " + "-" * 66 + " zerostate's own code, verbatim\n"
             "# Each module is loaded under its own name by _EmbeddedFinder, ahead of any installed zerostate\n"
             "# (none is needed, nor used): the scenario runs, and is judged, by the code explore used.\n"
             "EMBEDDED = {}\n"]
    for name, (package, source) in modules.items():
        parts.append(f"\n# {'-' * 20} {name} ({_module_file(name).name})\n"
                     f"EMBEDDED[{name!r}] = ({package!r}, {_literal(source)})\n")
    return "".join(parts)


def _expected(finding: Finding) -> tuple[str, list[dict[str, object]] | None]:
    """model-agreement: the model design's name and its trace of the scenario (computed now, embedded)."""
    if finding.check != "model-agreement":
        return "", None
    from zerostate.model.designs import design_for_release, get_design
    from zerostate.model.explore import run
    design = design_for_release(finding.deepspeed) if finding.deepspeed else get_design("ds-0.18.7")
    assert finding.scenario is not None, "a repro script reproduces a scenario"
    return design.name, [e.to_dict() for e in run(design, finding.scenario).events]


_MAIN = r'''

# ------------------------------------------------------------------ the run and the check
def run_before(executor, Scenario):
    """An order-dependent finding: the examples that ran before it in the same process, each in its own
    engine, built, trained and destroyed by zerostate's executor as its worker ran them; their own
    outcome is not judged."""
    for i, spec in enumerate(BEFORE):
        record = executor.execute(Scenario.from_dict(spec))
        if record.error:
            print(f"(sequence [{i + 1}] raised {record.error.splitlines()[0][:120]})")


def judge(executor, failed_checks, cross_rank_checks, scenario):
    """Run the scenario once; return (the failed checks, the run's record)."""
    import torch.distributed as dist
    steps = []
    record = executor.execute(scenario, on_step=lambda i, got: steps.append(cross_rank_checks.digests(got)))
    model_events = None
    if MODEL_EVENTS is not None:
        from zerostate.model.events import Event
        model_events = [Event.from_dict(d) for d in MODEL_EVENTS]
    failed = failed_checks(record, scenario, model_events, DESIGN)
    if dist.is_initialized() and dist.get_world_size() > 1 and record.raised is not None:
        # this rank left the run's collectives: the others may wait in one for ever, so no gather -- its own record
        # is the verdict, and torchrun stops the others when it exits
        print(f"(rank {dist.get_rank()}'s run raised: judged on its own record, the ranks' results not gathered)")
        return failed, record
    if dist.is_initialized() and dist.get_world_size() > 1:
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, cross_rank_checks.RankRun(dist.get_rank(), record, tuple(steps)))
        mine = failed
        failed = failed_checks(ranks[0].record, scenario, model_events, DESIGN)  # rank 0's, as the pool
        for check, problem in cross_rank_checks.cross_rank_problems(ranks, scenario).items():
            failed.setdefault(check, problem)
        if mine.keys() - failed.keys():
            print(f"(rank {dist.get_rank()} also fails: {sorted(mine.keys() - failed.keys())})")
    return failed, record


def main():
    """Run the finding's scenario (REPEAT times for an intermittent finding: a race), after BEFORE."""
    if CHECK.startswith("ranks-") and int(os.environ.get("WORLD_SIZE", "1")) < 2:
        print(f"{CHECK!r} compares ranks: run this script with torchrun --nproc-per-node "
              f"{max(2, SPEC.get('world_size', 1))}")
        return 2
    install_embedded()
    from zerostate import jit_ops
    jit_ops.keep_apart(os.environ)  # this release's own JIT-built ops, unless TORCH_EXTENSIONS_DIR says otherwise
    from zerostate.harness import cross_rank_checks
    from zerostate.harness import executor
    from zerostate.harness.net.dist import setup_distributed
    from zerostate.findings.decide import failed_checks
    from zerostate.model.scenario import Scenario
    scenario = Scenario.from_dict(SPEC)  # parsed once, as the worker does
    setup_distributed()
    run_before(executor, Scenario)
    if CHECK == "hang":
        import faulthandler
        faulthandler.dump_traceback_later(TIMEOUT, exit=True)  # exits 1 with every thread's stack
    for i in range(REPEAT):
        failed, record = judge(executor, failed_checks, cross_rank_checks, scenario)
        others = {k: v for k, v in failed.items() if k != CHECK}
        for check, (msg, detail) in sorted(others.items()):
            print(f"(also failed, not this finding's check: {check}{' ' + detail if detail else ''}: "
                  f"{msg.splitlines()[0][:300]})")
        if CHECK in failed:
            msg, detail = failed[CHECK]
            if record.raised is not None and record.raised.traceback:
                print(record.raised.traceback)
            same = "" if not DETAIL or detail == DETAIL else f" [{detail}; the finding's was {DETAIL}]"
            print(f"BUG PRESENT ({CHECK}){same}: {msg.splitlines()[0]}")
            if REPEAT > 1:
                print(f"(reproduced on run {i + 1} of up to {REPEAT})")
            return 1
        if record.error:
            print(f"the run raised before {CHECK!r} could be judged: {record.error.splitlines()[0]}")
            return 2
        if record.skipped:
            print(f"the scenario did not run: {record.skipped}")
            return 2
    print(f"OK: {CHECK} not reproduced (fixed?)" + (f" in {REPEAT} runs" if REPEAT > 1 else ""))
    return 0


'''

_LOADER = r'''
# ------------------------------------------------------------------ loading the embedded modules
class _EmbeddedFinder:
    """Serves the modules of EMBEDDED (and empty packages above them) ahead of any installed zerostate."""

    def find_spec(self, name, path=None, target=None):
        import importlib.util
        if name in EMBEDDED:
            return importlib.util.spec_from_loader(name, self, is_package=EMBEDDED[name][0])
        if any(n.startswith(name + ".") for n in EMBEDDED):
            return importlib.util.spec_from_loader(name, self, is_package=True)
        if name == "zerostate" or name.startswith("zerostate."):
            raise ModuleNotFoundError(f"{name} is not embedded in this repro script", name=name)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        import linecache
        name = module.__name__
        if module.__spec__.submodule_search_locations is not None:
            module.__path__ = []
        if name not in EMBEDDED:
            return
        source = EMBEDDED[name][1]
        filename = "<embedded>/" + name.replace(".", "/") + ("/__init__.py" if EMBEDDED[name][0] else ".py")
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        exec(compile(source, filename, "exec", dont_inherit=True), module.__dict__)


def install_embedded():
    sys.meta_path.insert(0, _EmbeddedFinder())


def leave_process_group():
    """Destroy the process group before the interpreter exits: left to interpreter shutdown, gloo's threads
    were once torn down under a rank (C++ 'terminate called without an active exception', SIGABRT) after
    it had printed its verdict, and torchrun then failed the run."""
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception as exc:  # the verdict is printed already: say so, and leave with it
        print(f"(leaving the process group failed: {type(exc).__name__}: {exc})", file=sys.stderr)


if __name__ == "__main__":
    code = main()
    leave_process_group()
    # the verdict is printed: leave without interpreter shutdown, whose C++ destructors (gloo's and DeepSpeed's
    # threads) can abort a rank after destroy_process_group ('terminate called without an active exception',
    # SIGABRT), which would make torchrun fail a judged run
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
'''


def _before_text(before: list) -> str:
    if not before:
        return ""
    return (f"Order-dependent: the finding appears only after {len(before)} other example(s) ran in the same\n"
            "process (BEFORE, each built, trained and destroyed first, as zerostate's worker ran them).\n")


def _repeat_text(repeat: int) -> str:
    return (f"Intermittent (a race): the scenario runs up to {repeat} times, one engine after another; the\n"
            "bug is present when any run shows it.\n") if repeat > 1 else ""


def repro_script(finding: Finding, n: int | None = None) -> str:
    """A standalone script reproducing ``finding`` (a `Finding`); exits 1 while the bug is present."""
    sc = finding.scenario
    assert sc is not None, "a repro script reproduces a scenario"
    spec = json.dumps(sc.to_dict(), indent=1, sort_keys=True)
    conf = finding.confirmation  # explorer/confirm.py: an order-dependent finding's sequence
    before = [s.to_dict() for s in (conf.sequence if conf is not None else [])]
    repeat = (conf.repeat or 1) if conf is not None and conf.status == "intermittent" else 1
    first = (finding.error or "").strip().splitlines()[0] if finding.error else ""
    where = f"DeepSpeed {finding.deepspeed}" if finding.deepspeed else "DeepSpeed"
    name = f"repro_{n}.py" if n is not None else "repro.py"
    desc = "\n".join("    " + ln for ln in sc.describe().splitlines())
    design, model_events = _expected(finding)
    detail = finding.origin or finding.code
    ws = finding.world_size  # set by the rank pool (ranks.py) on its findings
    if ws > 1:
        run = (f"Run:  torchrun --nproc-per-node {ws} {name}   (CPU: gloo; each rank trains on its share of the\n"
               f"                                          global batch, the oracle on all of it)\n"
               f"      deepspeed --num_gpus {ws} {name}        (GPUs, nccl)")
    else:
        run = (f"Run:  python {name}                    (CPU: DS_ACCELERATOR=cpu, gloo, world size 1, set up here)\n"
               f"      deepspeed --num_gpus 1 {name}    (GPU)")
    head = f'''#!/usr/bin/env python3
"""zerostate repro: {finding.check} on {where}.

    {first[:300]}

Scenario:
{desc}

{run}
{_before_text(before)}{_repeat_text(repeat)}Exit: 1 while the bug is present ({finding.check} fails), \
0 once it is fixed; 2 when
the run raised before {finding.check} could be judged.  Other checks that fail are listed, not counted.

Generated by zerostate.  The scenario runs, and is judged, by zerostate's own code, embedded verbatim
below (the executor, its network and training loop, the tracer, the specs and the model-agreement
projection): the check is the one explore made.
"""
'''
    events = "None" if model_events is None else \
        "json.loads(r'''[\n" + ",\n".join(json.dumps(e, sort_keys=True) for e in model_events) + "\n]''')"
    parts = [
        head,
        "from __future__ import annotations\n\nimport json\nimport os\nimport sys\n",
        (f"CHECK = {finding.check!r}\nDETAIL = {detail!r}  # the finding's origin (an exception) or violation code\n"
         f"TIMEOUT = 120\nSPEC = json.loads(r'''{spec}''')\n"),
        f"BEFORE = json.loads(r'''{json.dumps(before)}''')\nREPEAT = {repeat}\n",
        (f"DESIGN = {design!r}  # model-agreement: the model design and its trace of the scenario\n"
         f"MODEL_EVENTS = {events}\n"),
        _MAIN,
        _embedded_text(),
        _LOADER,
    ]
    return "\n".join(parts)


__all__ = ["embedded_modules", "repro_script"]
