"""Harness error or DeepSpeed finding by module identity, never by folder names: a frame belongs to zerostate when
its code was imported as a ``zerostate`` module, to DeepSpeed when as ``deepspeed`` -- whatever folder holds the
file: a checkout in a folder named ``zerostate``, an installed wheel, a checkout in any other folder, a DeepSpeed
checkout given by ``--deepspeed-path``."""

from __future__ import annotations

import functools

import pytest

from zerostate.findings.build import findings_of
from zerostate.findings.decide import decide
from zerostate.findings.harness import harness_error
from zerostate.findings.origin import origin_of
from zerostate.findings.record import RunRecord
from zerostate.harness.observe import exception_record, frames_of
from zerostate.model.events import Event, EventKind
from zerostate.model.scenario import Scenario

pytestmark = pytest.mark.fast

LAYOUTS = {
    "checkout named zerostate": "/home/u/zerostate",
    "checkout named otherwise": "/home/u/src",
    "installed wheel": "/venv/lib/python3.11/site-packages/zerostate",
    "checkout inside a folder named deepspeed": "/work/deepspeed/zerostate-main",
}
DEEPSPEED_AT = {"release": "/venv/lib/python3.11/site-packages/deepspeed",
                "--deepspeed-path checkout": "/home/u/DeepSpeed/deepspeed",
                "cached release": "/root/.cache/zerostate/deepspeed/0.19.2/site/deepspeed"}


def _raise_through(frames: list[tuple[str, str, str]]) -> BaseException:
    """An exception raised through functions of the given (module, file, function), outermost first."""
    chain = None
    for module, file, function in reversed(frames):
        glb: dict = {"__name__": module}
        src = (f"def {function}(rest):\n    return rest()\n" if chain is not None else
               f"def {function}(rest):\n    raise RuntimeError('The size of tensor a (0) must match')\n")
        exec(compile(src, file, "exec"), glb)
        fn, nxt = glb[function], chain
        chain = functools.partial(fn, nxt)
    try:
        chain()
    except RuntimeError as exc:
        return exc
    raise AssertionError("nothing raised")


def _record(exc: BaseException) -> RunRecord:
    return RunRecord(events=(Event(EventKind.FORWARD_START),),
                     raised=exception_record(exc, f"{type(exc).__name__}: {exc}", 12))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("ds_at", sorted(DEEPSPEED_AT))
def test_a_tracer_error_is_zerostates_and_a_deepspeed_one_deepspeeds_in_every_layout(layout, ds_at):
    root, ds = LAYOUTS[layout], DEEPSPEED_AT[ds_at]
    mine = [("zerostate.harness.executor", f"{root}/harness/executor.py", "execute"),
            ("deepspeed.runtime.engine", f"{ds}/runtime/engine.py", "backward"),
            ("zerostate.tracing.harness_tracer", f"{root}/tracing/harness_tracer.py", "on_hook")]
    theirs = [("zerostate.harness.executor", f"{root}/harness/executor.py", "execute"),
              ("zerostate.harness.net.engine", f"{root}/harness/net/engine.py", "backward"),
              ("deepspeed.runtime.zero.stage3", f"{ds}/runtime/zero/stage3.py", "reduce_ipg_grads")]
    sc = Scenario()
    for frames, own in ((mine, True), (theirs, False)):
        rec = _record(_raise_through(frames))
        placed = [(f.package, f.file) for f in rec.raised.frames if f.module != __name__][-3:]
        assert [p for p, _ in placed] == ["zerostate", "deepspeed" if own else "zerostate",
                                          "zerostate" if own else "deepspeed"], placed
        (f,) = [x for x in findings_of(decide(rec, sc), sc, list(rec.events), "deepspeed", "0.19.8")
                if x.check == "exception"]
        assert bool(harness_error(f)) is own, (layout, ds_at, harness_error(f))
    assert origin_of(_record(_raise_through(theirs)).raised) == "RuntimeError@runtime.zero.stage3.reduce_ipg_grads"


def test_frames_name_the_file_inside_the_package_by_module():
    exc = _raise_through([("deepspeed.runtime.zero", "/x/deepspeed/runtime/zero/__init__.py", "f"),
                          ("zerostate.harness.net.torch_network", "/any/where/net/torch_network.py", "forward")])
    files = [(f.package, f.file, f.module) for f in frames_of(exc) if f.module != __name__][-2:]
    assert files == [("deepspeed", "runtime/zero/__init__.py", "deepspeed.runtime.zero"),
                     ("zerostate", "harness/net/torch_network.py", "zerostate.harness.net.torch_network")]
