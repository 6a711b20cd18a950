"""llama.cpp's own batched decode on the same GGUF, through llama-cpp-python's low-level API.

The peer for `kvlab bench throughput`: every prompt is a sequence id of one llama.cpp
context, all prompts are decoded in batches of at most n_batch tokens, then each step feeds
one `llama_batch` with the newest token of every sequence (each with logits) and takes the
argmax, exactly `output_len` times: what llama.cpp's `batched` example does (an AMX build of
llama.cpp runs with its weight repacking off, see AMX_REBUILD). llama-cpp-python
is an optional extra (`pip install llama-cpp-python`, a source build of several minutes):
`run_llama_cpp` returns None when it is absent.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Iterator, Optional


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence the C library's own writes to file descriptor 2 for a moment."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


# llama-cpp-python 0.3.36 built for a CPU with AMX (its default, native build on a Sapphire
# Rapids Xeon) repacks the weights for AMX at load and then segfaults in the first llama_decode
# on SmolLM2's Q4_1 file (ggml-org/llama.cpp#20824 reports the same crash in
# ggml_backend_amx_mul_mat). Built without AMX it runs; so does an AMX build with the extra
# buffer types off, which on this file costs nothing: its CPU repacking does not take Q4_1.
AMX_REBUILD = ('CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON '
               '-DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF" pip install '
               '--force-reinstall --no-cache-dir --no-deps llama-cpp-python')


def amx_build() -> bool:
    """Whether the installed llama.cpp was built with its AMX kernels (which crash on this file)."""
    import llama_cpp

    return "AMX_INT8 = 1" in llama_cpp.llama_print_system_info().decode(errors="replace")


def run_llama_cpp(path: str, prompts: list[list[int]], output_len: int, threads: int) -> Optional[dict]:
    """Greedy batched decode of `prompts` (token ids) for `output_len` tokens each; None without llama-cpp-python."""
    try:
        import llama_cpp
    except ImportError:
        return None
    import numpy as np

    llama_cpp.llama_backend_init()
    model_params = llama_cpp.llama_model_default_params()
    repacking = not amx_build()
    model_params.use_extra_bufts = repacking  # off on an AMX build: see AMX_REBUILD
    with _quiet_stderr():  # llama.cpp logs every tensor and buffer while loading
        model = llama_cpp.llama_model_load_from_file(path.encode(), model_params)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    n, longest = len(prompts), max(len(p) for p in prompts)
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = n * (longest + output_len + 1)  # the unified cache holds every sequence
    params.n_batch = params.n_ubatch = 512
    params.n_seq_max = n
    params.n_threads = params.n_threads_batch = threads
    with _quiet_stderr():
        ctx = llama_cpp.llama_init_from_model(model, params)
    if not ctx:
        raise RuntimeError("llama.cpp could not create a context")
    vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    batch = llama_cpp.llama_batch_init(512, 0, 1)

    def decode(entries: list[tuple[int, int, int, bool]]) -> None:
        batch.n_tokens = len(entries)
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, int(logits)
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def argmax(index: int) -> int:
        row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, index), shape=(vocab,))
        return int(row.argmax())

    try:
        started = time.perf_counter()
        entries = [(t, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, t in enumerate(p)]
        next_ids = [0] * n
        for at in range(0, len(entries), 512):  # the prompts, 512 tokens a batch; last tokens carry logits
            chunk = entries[at:at + 512]
            decode(chunk)
            for i, (_, _, seq, logits) in enumerate(chunk):
                if logits:
                    next_ids[seq] = argmax(i)
        prefill = time.perf_counter() - started
        outputs = [[t] for t in next_ids]
        for step in range(1, output_len):
            decode([(next_ids[s], len(prompts[s]) + step - 1, s, True) for s in range(n)])
            next_ids = [argmax(s) for s in range(n)]
            for s in range(n):
                outputs[s].append(next_ids[s])
        elapsed = time.perf_counter() - started
    finally:
        with _quiet_stderr():
            llama_cpp.llama_batch_free(batch)
            llama_cpp.llama_free(ctx)
            llama_cpp.llama_model_free(model)
    tokens = n * output_len
    return {"num_requests": n, "elapsed_s": elapsed, "prefill_s": prefill, "output_tokens": tokens,
            "output_tokens_per_s": tokens / elapsed, "outputs": outputs,
            "version": getattr(llama_cpp, "__version__", None), "weight_repacking": repacking,
            "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip()}
