'''Standalone reproduction scripts: ``repro_script(finding) -> str``.

The script needs only torch and deepspeed.  It embeds, verbatim (``inspect.getsource``):

* `net` -- the network, the DeepSpeed config and the training loop the executor ran;
* `compat` -- the one module that knows where releases differ (for the checks that
  wrap DeepSpeed functions);

plus the scenario as JSON and the minimal check for the finding's check id:

* ``exception``, ``saved-tensor-intact``, ``crash``: the schedule raises (exit 1);
* ``hang``: no exit within the timeout (``faulthandler`` dumps the stacks, exit 1);
* ``oracle``: the parameters after a train step differ from plain PyTorch (exit 1);
* ``count-once-per-phase``: ``count_used_parameters_in_backward`` is wrapped where stage3 /
  stage_1_and_2 imported it, and called twice in one autograd graph task between forwards;
* ``epilogue-once``, ``grad-handled-once``, ``no-epilogue-before-user-backward``, ``clean-step``:
  the epilogue (``engine._backward_epilogue``) and the gradient sink each hook calls are wrapped,
  and the order is checked per user backward;
* ``model-agreement``: the same observations, projected as `agreement.project` does, compared with
  the model's prediction embedded at generation time;
* ``released-after-backward``: after each user backward (its epilogue included) no non-persistent
  ZeRO-3 parameter is gathered or held (``ds_status``, ``ds_active_sub_modules``).

Other checks (``available-when-used``, ``trace-consistent``) fall back to "the schedule raises" and
exit 2 when it does not; the script says so.

Run on CPU with ``python repro_N.py`` (it sets ``DS_ACCELERATOR=cpu``, gloo, ``MASTER_ADDR`` ...
itself when there is no GPU) or on GPUs with ``deepspeed --num_gpus 1 repro_N.py``.  Exit status:
1 while the bug is present, 0 once it is fixed (2: this script cannot judge the check).
'''

from __future__ import annotations

import inspect
import json
import re

from zerostate.model import eras

from . import compat, net

WATCHED = {"count-once-per-phase", "epilogue-once", "grad-handled-once", "no-epilogue-before-user-backward",
           "clean-step", "model-agreement", "released-after-backward"}
RAISES = {"exception", "saved-tensor-intact", "crash", "internal"}


def _source(module) -> str:
    """A module's source to embed: no ``from __future__`` line, and no import of the modules embedded before
    it (``compat`` imports the era table, which the script carries above it)."""
    src = inspect.getsource(module)
    src = re.sub(r"^from __future__ import annotations\n", "", src, flags=re.M)
    return re.sub(r"^from zerostate\.model\.eras import .*\n", "", src, flags=re.M)


def _expected(finding) -> list | None:
    """The model design's projection for model-agreement (computed now, embedded as data)."""
    if finding.check != "model-agreement":
        return None
    from zerostate.model.designs import design_for_release, get_design
    from zerostate.model.explore import run
    from .agreement import project
    design = design_for_release(finding.deepspeed) if finding.deepspeed else get_design("ds-0.18.7")
    return [[w, v] for w, v in project(run(design, finding.scenario).events)]


_WATCH = r'''
# ------------------------------------------------------------------ the check
class Watch:
    """Wrap the epilogue, the gradient sink and count_used_parameters_in_backward; log what ran."""

    def __init__(self, engine, spec):
        import importlib
        self.engine, self.opt, self.log, self.undo = engine, engine.optimizer, [], []
        self.names = {id(p): n for n, p in engine.module.named_parameters()}
        stage = spec.get("stage", 3)
        leaf = sum(1 for b in spec.get("blocks", [{}]) if b.get("leaf")) if stage == 3 else 0
        task = torch._C._current_graph_task_id

        def patch(obj, attr, make):
            if obj is None or not hasattr(obj, attr):
                return
            orig = getattr(obj, attr)
            self.undo.append((obj, attr, orig, attr in getattr(obj, "__dict__", {})))
            setattr(obj, attr, make(orig))

        def sink(f):
            def wrapped(param, *a, **k):
                self.log.append(("grad", self.names.get(id(param)), task()))
                return f(param, *a, **k)
            return wrapped

        def count(f):
            def wrapped(*a, **k):
                v = f(*a, **k)
                self.log.append(("count", task(), int(v) + leaf))
                return v
            return wrapped

        def epilogue(f):
            def wrapped(*a, **k):
                self.log.append(("epilogue", task(), None))
                return f(*a, **k)
            return wrapped

        def pre_step(f):
            def wrapped(*a, **k):
                n = stale_bucket_count(self.opt)
                r = f(*a, **k)
                if n and stale_bucket_count(self.opt) < n:
                    self.log.append(("clear", n, None))
                return r
            return wrapped

        patch(self.opt, grad_sink(stage), sink)
        for m in COUNT_MODULES:
            patch(importlib.import_module(m), COUNT_NAME, count)
        patch(engine, "_backward_epilogue", epilogue)
        if stage == 3:
            patch(self.opt, "_pre_step", pre_step)

    def mark(self, what, **info):
        if what in ("forward_start", "eval_start"):
            self.log.append(("state", depth(self.opt), stale_bucket_count(self.opt)))
        self.log.append((what, info.get("kind"), info.get("step")))
        if what == "backward_end":  # the epilogue has run: nothing non-persistent may stay gathered
            kept = [n for n, p in self.engine.module.named_parameters() if hasattr(p, "ds_status")
                    and not is_persistent(p) and (param_status(p) != "NOT_AVAILABLE" or holders(p))]
            if kept:
                self.log.append(("kept", kept, None))


def project(log):
    """What agreement.project computes, from the Watch log."""
    out, cur, fwd, nb, nf, ns = [], None, None, 0, 0, 0
    for what, a, b in log:
        if what in ("forward_start", "eval_start", "step") and cur is not None:
            cur["handled"] = sorted(cur["handled"])
            out.append((cur.pop("where"), cur))
            cur = None
        if what == "forward_start":
            fwd, nf = {"where": f"forward #{nf}", "counts": 0, "epilogues": 0}, nf + 1
        elif what == "forward_end" and fwd is not None:
            out.append((fwd.pop("where"), fwd))
            fwd = None
        elif what == "backward_start":
            cur = {"where": f"user backward #{nb} ({a})", "epilogues": 0, "late_hook": False, "counts": 0,
                   "handled": set()}
            nb += 1
        elif what == "step":
            out.append((f"engine.step() #{ns}", {"stale_cleared": False}))
            ns += 1
        elif what == "clear" and out and out[-1][0].startswith("engine.step()"):
            out[-1][1]["stale_cleared"] = bool(a)
        t = fwd if fwd is not None else cur
        if t is None:
            continue
        if what == "epilogue":
            t["epilogues"] += 1
        elif what == "count":
            t["counts"] += 1
        elif t is cur and what == "grad":
            if cur["epilogues"]:
                cur["late_hook"] = True
            cur["handled"].add(a)
    if cur is not None:
        cur["handled"] = sorted(cur["handled"])
        out.append((cur.pop("where"), cur))
    return [[w, v] for w, v in out]


def verdict(check, log):
    """A sentence describing the violation of `check` in the log, or None."""
    counted, bucket, window, handled, epis, after_step = set(), set(), None, set(), 0, False
    for what, a, b in log + [("end", None, None)]:
        closes = what in ("forward_start", "eval_start", "step", "end")
        if closes and window is not None:
            if check == "epilogue-once" and epis != 1:
                return f"{window}: the epilogue ran {epis} times"
            if check == "grad-handled-once" and bucket:
                return f"{window}: gradients left in the reduce bucket after the backward: {sorted(bucket)}"
            window = None
        if what == "state" and after_step:
            after_step = False
            if check == "clean-step" and (a or b or bucket):
                return (f"after engine.step(): backward depth {a}, {b} stale params in DeepSpeed's ipg buckets, "
                        f"unreduced gradients {sorted(bucket)}")
        if what == "forward_start":
            counted = set()
        elif what == "backward_start":
            window, handled, epis = f"user backward ({a})", set(), 0
        elif what == "step":
            after_step = True
        elif what == "count":
            if check == "count-once-per-phase" and a in counted:
                return f"count_used_parameters_in_backward evaluated again in graph task {a} (once per phase)"
            counted.add(a)
        elif what == "grad":
            if window is not None:
                if check == "epilogue-once" and epis:
                    return f"{window}: gradient hook for {a} fired after the epilogue"
                if check == "grad-handled-once" and a in handled:
                    return f"{window}: gradient of {a} handled twice"
                handled.add(a)
            bucket.add(a)
        elif what == "epilogue":
            if window is None and check == "no-epilogue-before-user-backward":
                return "the epilogue ran outside a user backward (a backward made inside forward)"
            epis += 1
            bucket = set()
        elif what == "clear":
            bucket = set()
        elif what == "kept" and check == "released-after-backward":
            return f"after the backward (and its epilogue) {', '.join(a)} still gathered or held"
    return None
'''

_MAIN = r'''

def run_before():
    """An order-dependent finding: the examples that ran before it in the same process, each in its own
    engine, built, trained and destroyed as zerostate's worker does; their own outcome is not judged."""
    import gc
    for i, spec in enumerate(BEFORE):
        if not any(b.get(k, "trainable") != "frozen" for b in spec.get("blocks", [{}]) for k in ("norm", "lin")) \
                and not spec.get("fused_head", False):
            continue  # the worker skips it too: nothing to train
        model = build_model(spec)
        backend = None
        try:
            oracle_params(spec)
            backend = DeepSpeedBackend(spec, model)
            run_schedule(spec, backend)
        except Exception as exc:
            print(f"(sequence [{i + 1}] raised {type(exc).__name__}: {str(exc).splitlines()[0][:120]})")
        finally:
            if backend is not None:
                backend.close()
            clear_globals()
            del backend, model
            gc.collect()


def main():
    """Run the finding's scenario (REPEAT times for an intermittent finding: a race), after BEFORE."""
    import gc
    setup_distributed()
    run_before()
    for i in range(REPEAT):
        rc = one()
        for backend in _OPEN:
            backend.close()
        _OPEN.clear()
        clear_globals()
        gc.collect()
        if rc != 0:
            if REPEAT > 1:
                print(f"(reproduced on run {i + 1} of up to {REPEAT})")
            return rc
    print(f"OK: {CHECK} not reproduced (fixed?)" + (f" in {REPEAT} runs" if REPEAT > 1 else ""))
    return rc


_OPEN = []


def one():
    if CHECK == "hang":
        import faulthandler
        faulthandler.dump_traceback_later(TIMEOUT, exit=True)  # exits 1 with every thread's stack
    model = build_model(SPEC)
    expected = oracle_params(SPEC) if CHECK == "oracle" else None
    backend = DeepSpeedBackend(SPEC, model)
    _OPEN.append(backend)
    watch = Watch(backend.engine, SPEC) if CHECK in WATCHED else None
    problems = []

    def after_step(i):
        if expected is not None:
            msg = compare(expected[i], backend.params(), *tolerance(SPEC))
            if msg:
                problems.append(f"after train step {i}: {msg}")

    try:
        run_schedule(SPEC, backend, mark=watch.mark if watch else None, after_step=after_step)
    except Exception as exc:
        import traceback
        traceback.print_exc()
        msg = (f"{type(exc).__name__}: {exc}".splitlines() or [""])[0]
        print(f"\nBUG PRESENT ({CHECK}): {msg}")
        return 1
    if watch is not None:
        if CHECK == "model-agreement":
            got = json.loads(json.dumps(project(watch.log)))
            if got != EXPECTED:
                for (gw, gv), (ew, ev) in zip(got, EXPECTED):
                    if [gw, gv] != [ew, ev]:
                        problems.append(f"{gw}: DeepSpeed did {gv}, the model predicts {ev}")
                        break
                else:
                    problems.append(f"{len(got)} observable sections, the model predicts {len(EXPECTED)}")
        else:
            msg = verdict(CHECK, watch.log)
            if msg:
                problems.append(msg)
    if problems:
        print(f"BUG PRESENT ({CHECK}): " + problems[0])
        return 1
    if CHECK not in WATCHED and CHECK not in RAISES and CHECK not in ("oracle", "hang"):
        print(f"ran without an exception; this script cannot judge {CHECK!r} by itself "
              "(use zerostate replay)")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
'''


def _before_text(before: list) -> str:
    if not before:
        return ""
    return (f"Order-dependent: the finding appears only after {len(before)} other example(s) ran in the same\n"
            "process (BEFORE, each built, trained and destroyed first, as zerostate's worker ran them).\n")


def _repeat_text(repeat: int) -> str:
    return (f"Intermittent (a race): the scenario runs up to {repeat} times, one engine after another; the\n"
            "bug is present when any run shows it.\n") if repeat > 1 else ""


def repro_script(finding, n: int | None = None) -> str:
    """A standalone script reproducing ``finding`` (a `Finding`); exits 1 while the bug is present."""
    sc = finding.scenario
    spec = json.dumps(sc.to_dict(), indent=1, sort_keys=True)
    conf = getattr(finding, "confirmation", None)  # targets/confirm.py: an order-dependent finding's sequence
    before = [s.to_dict() for s in (getattr(conf, "sequence", None) or [])]
    repeat = int(getattr(conf, "repeat", 0) or 1) if getattr(conf, "status", "") == "intermittent" else 1
    first = (finding.error or "").strip().splitlines()[0] if finding.error else ""
    where = f"DeepSpeed {finding.deepspeed}" if getattr(finding, "deepspeed", None) else "DeepSpeed"
    name = f"repro_{n}.py" if n is not None else "repro.py"
    desc = "\n".join("    " + ln for ln in sc.describe().splitlines())
    expected = _expected(finding)
    ws = int(getattr(finding, "world_size", 1) or 1)  # set by the rank pool (ranks.py) on its findings
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
{_before_text(before)}{_repeat_text(repeat)}Exit: 1 while the bug is present, 0 once it is fixed.
Generated by zerostate from the network and training loop its executor runs
(zerostate/targets/deepspeed/net.py, embedded verbatim below).
"""
'''
    parts = [
        head,
        "from __future__ import annotations\n\nimport json\nimport sys\n",
        f"CHECK = {finding.check!r}\nTIMEOUT = 120\nSPEC = json.loads(r'''{spec}''')\n",
        f"EXPECTED = json.loads(r'''{json.dumps(expected)}''')\n",
        f"BEFORE = json.loads(r'''{json.dumps(before)}''')\nREPEAT = {repeat}\n",
        f"WATCHED = {sorted(WATCHED)!r}\nRAISES = {sorted(RAISES)!r}\n",
        "\n# " + "-" * 66 + " era table (zerostate/model/eras.py, verbatim)\n",
        _source(eras),
        "\n# " + "-" * 66 + " compat (zerostate/targets/deepspeed/compat.py, verbatim)\n",
        _source(compat),
        "\n# " + "-" * 66 + " network and training loop (zerostate/targets/deepspeed/net.py, verbatim)\n",
        _source(net),
        _WATCH,
        _MAIN,
    ]
    return "\n".join(parts)


__all__ = ["repro_script"]
