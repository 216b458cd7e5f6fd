"""Child processes for tests/test_stream_dist.py (forked there with ``main(argv)``; or as a script:
``python tests/stream_worker.py MODE ...``).

* ``kill INPUTS CKPT EXIT_AT``: a checkpointed run that the fault hook ends with ``os._exit(17)`` at task EXIT_AT.
* ``rank RANK WORLD INIT_FILE INPUTS RESULT EXIT_AT TIMEOUT_S [CKPT | grad]``: one gloo rank (init_method
  file://); it writes ``RESULT`` (torch.save of {"out" or "error", "seconds"}); EXIT_AT >= 0 kills this rank at that
  task; CKPT: a checkpointed run (saved after every task); ``grad``: also the backward of ``out · g`` (dq, dk, dv).
"""

import os
import sys
import time
from datetime import timedelta

import torch


def main(argv):
    torch.set_num_threads(1)
    torch.cuda.is_available = lambda: False  # the CPU path, as the tests' autouse fixture (spawned children too)
    from elsa_surgery import stream
    from elsa_surgery.stream import faults

    mode = argv[0]
    if mode == "kill":
        inputs, ckpt, exit_at = argv[1], argv[2], int(argv[3])
        d = torch.load(inputs)
        with faults.inject(exit_at=exit_at):
            stream.attention(d["q"], d["k"], d["v"], progress=False, checkpoint_dir=ckpt, checkpoint_every=0.0,
                             **d["kw"])
        raise SystemExit("the fault hook did not end the run")
    if mode == "rank":
        import torch.distributed as dist

        rank, world, init, inputs, result, exit_at, timeout = argv[1:8]
        rank, world, exit_at = int(rank), int(world), int(exit_at)
        grad = len(argv) > 8 and argv[8] == "grad"  # the backward: q, k, v require grad, out.backward(d["g"])
        ck = dict(checkpoint_dir=argv[8], checkpoint_every=0.0) if len(argv) > 8 and not grad else {}
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=float(timeout)))
        d = torch.load(inputs)
        from elsa_surgery.stream import executor

        executor.PEND_ON_ONE_DEVICE = d.get("pend", False)  # the CUDA path's pending states, on the CPU
        t = time.perf_counter()
        try:
            q, k, v = (x.requires_grad_(grad) for x in (d["q"], d["k"], d["v"]))
            with faults.inject(exit_at=exit_at if exit_at >= 0 else None):
                out = stream.attention(q, k, v, progress=False, **d["kw"], **ck)
            grads = {}
            if grad:
                out.backward(d.get(f"g_rank{rank}", d["g"]))
                grads = {"dq": q.grad, "dk": k.grad, "dv": v.grad}
                out = out.detach()
            torch.save({"out": out, "seconds": time.perf_counter() - t, "report": vars(stream.last_report()),
                        **grads}, result)
        except Exception as e:  # reported to the parent test
            torch.save({"error": f"{type(e).__name__}: {e}", "seconds": time.perf_counter() - t}, result)
            # the result is on disk: leave without tearing the failed group down (one CI run, session 32 on 2
            # cores, saw a refusing rank end with exit -6, "terminate called without an active exception", where its
            # peer exited 3; if that abort came before the save, the parent's check of the saved error still fails)
            os._exit(3)
        finally:
            if "out" in locals():
                dist.destroy_process_group()
        # the result is on disk: leave without the interpreter's teardown, which can race gloo's threads (session 37's
        # CI on 2 cores: a rank that had saved its result and destroyed its group ended with exit -6, "terminate
        # called without an active exception")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main(sys.argv[1:])
