"""The offline API, as vLLM's: `LLM(model, ...).generate(prompts, SamplingParams(...))`.

    from kvlab import LLM, SamplingParams
    llm = LLM("smollm2-135m", kv_cache_dtype="fp16")
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    print(out[0].outputs[0].text, out[0].outputs[0].finish_reason)

All prompts go into one engine at once and are batched continuously; outputs come back in
the order of the prompts, each with `n` completions (SamplingParams(n=...)). The other
request extras are SamplingParams' fields too, as in vLLM: penalties, logit_bias, min_tokens,
prompt_logprobs (RequestOutput.prompt_logprobs) and structured outputs:

    from kvlab.engine.structured import StructuredOutputsParams
    params = SamplingParams(n=2, max_tokens=64, structured_outputs=StructuredOutputsParams(json=schema))
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

from kvlab.engine.engine import EngineConfig, LLMEngine
from kvlab.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvlab.engine.sampling import SamplingParams

Prompt = Union[str, Sequence[int]]


def load_for_engine(model: str, weights: str = "auto", dtype: str = "fp32", threads: Optional[int] = None):
    """(model, tokenizer) for a name, a .gguf file or a Hugging Face directory, as `kvlab generate` loads it."""
    from kvlab.cache.base import TORCH_DTYPES
    from kvlab.checkpoints.resolve import load_checkpoint, resolve_packing
    from kvlab.nn.threads import fix_threads

    if threads:
        fix_threads(threads)
    loaded = load_checkpoint(model, TORCH_DTYPES[dtype], resolve_packing(weights))
    return loaded.model, loaded.tokenizer


def kv_calibration_for(model: str, kv_cache_dtype: Optional[str], explicit: Optional[str] = None) -> Optional[str]:
    """The KVQuant calibration a kvquant3/kvquant4 engine loads: `explicit`, else the file `kvlab calibrate-kv`
    writes beside the model (`kvlab eval`'s default too); None for the other formats."""
    if explicit or not (kv_cache_dtype or "").startswith("kvquant"):
        return str(explicit) if explicit else None
    from kvlab.cache.kvquant_calibration import default_calibration_path
    from kvlab.checkpoints.resolve import resolve_model_path
    return str(default_calibration_path(resolve_model_path(model)))


class LLM:
    def __init__(self, model: str, *, weights: str = "auto", dtype: str = "fp32", threads: Optional[int] = None,
                 **engine_args) -> None:
        """`engine_args` are EngineConfig's fields: kv_cache_dtype, kv_cache_memory, block_size, max_num_seqs, ..."""
        net, tokenizer = load_for_engine(model, weights, dtype, threads)
        engine_args["kv_calibration"] = kv_calibration_for(model, engine_args.get("kv_cache_dtype"),
                                                           engine_args.get("kv_calibration"))
        self.engine = LLMEngine(net, tokenizer, EngineConfig(**engine_args))

    def generate(self, prompts: Union[Prompt, list[Prompt]], sampling_params: Union[SamplingParams,
                 list[SamplingParams], None] = None, use_tqdm: bool = False) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        engine = self.engine
        groups = []
        try:
            for p, sp in zip(prompts, params):
                sp = sp or SamplingParams()
                groups.append(engine.add_samples(p, sp) if sp.n > 1 else [engine.add_request(p, sp)])
        except Exception:
            for seq in (s for group in groups for s in group):
                engine.abort(seq.request_id)
            raise
        texts = {seq.request_id: [] for group in groups for seq in group}
        bar = None
        if use_tqdm:
            from kvlab.train.progress import progress_bar
            bar = progress_bar(len(texts), "requests", unit="req")
        while engine.has_unfinished():
            for delta in engine.step():
                texts[delta.request_id].append(delta.text)
                if delta.finished and bar is not None:
                    bar.update()
        if bar is not None:
            bar.close()
        out = []
        for p, group in zip(prompts, groups):
            first = group[0]
            outputs = [CompletionOutput(i, "".join(texts[seq.request_id]), list(seq.output_ids), seq.finish_reason,
                                        seq.logprobs or None) for i, seq in enumerate(group)]
            request_id = first.request_id.split("_", 1)[1] if len(group) > 1 else first.request_id  # "0_req-3"
            out.append(RequestOutput(request_id, p if isinstance(p, str) else None, first.prompt_ids, outputs,
                                     True, RequestMetrics(first.arrival, first.first_scheduled, first.first_token_time,
                                                          first.last_token_time, first.num_cached_prompt,
                                                          first.preemptions),
                                     first.prompt_logprobs or None))
        return out

    def chat(self, messages: Union[list[dict], list[list[dict]]], sampling_params: Optional[SamplingParams] = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.engine.tokenizer
        # as `kvlab generate --chat`: the template's text, with the tokenizer's BOS rule when it has one
        prompts = [tokenizer.encode(tokenizer.render_chat(c), add_bos=False if tokenizer.bos_id is None else None)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)
