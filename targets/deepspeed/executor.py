"""Run one scenario on real DeepSpeed (inside the worker process), traced, beside the PyTorch oracle.

`execute(spec)` returns a plain, JSON-serialisable dict:

``events``      the tracer's events (dicts of `zerostate.model.events.Event` fields);
``error``       ``"ExcType: message"`` when DeepSpeed (or torch inside it) raised, else None;
``error_check`` ``"saved-tensor-intact"`` for a torch ``CheckpointError``, ``"exception"`` otherwise;
``traceback``   the last lines of the traceback;
``mismatch``    the first oracle disagreement (``"after train step i: <param>: ..."``), else None;
``steps``       train steps compared with the oracle.

The engine is torn down after every scenario (tracer uninstalled, ``engine.destroy()``, ZeRO-3's
module stack cleared, ``gc.collect()``), so one worker process serves every example.
"""

from __future__ import annotations

import gc
import traceback

from . import compat, net
from .tracer import Tracer


def execute(spec: dict) -> dict:
    res: dict = {"events": [], "error": None, "error_check": None, "traceback": None, "mismatch": None,
                 "steps": 0}
    try:
        expected = net.oracle_params(spec)
    except Exception as exc:  # the oracle itself failed: the scenario is not trainable in plain PyTorch
        res.update(error=f"oracle: {type(exc).__name__}: {exc}", error_check="oracle-error",
                   traceback="".join(traceback.format_exc().splitlines(True)[-8:]))
        return res
    model = net.build_model(spec)
    backend = tracer = None
    try:
        backend = net.DeepSpeedBackend(spec, model)
        tracer = Tracer(backend.engine, spec).install()

        def after_step(i: int) -> None:
            with tracer.paused():
                got = backend.params()
            res["steps"] = i + 1
            msg = net.compare(expected[i], got)
            if msg and res["mismatch"] is None:
                res["mismatch"] = f"after train step {i}: {msg}"

        net.run_schedule(spec, backend, mark=tracer.mark, after_step=after_step)
    except Exception as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"
        res["error_check"] = "saved-tensor-intact" if compat.is_checkpoint_error(exc) else "exception"
        res["traceback"] = "".join(traceback.format_exc().splitlines(True)[-12:])
    finally:
        if tracer is not None:
            res["events"] = tracer.events
            tracer.uninstall()
        if backend is not None:
            backend.close()
        compat.clear_globals()
        del backend, tracer, model
        gc.collect()
    return res
