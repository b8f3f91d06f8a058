"""Runs the `tandem bench engine` workload on vLLM, for a side-by-side ratio in the same run.

Executed by `tandem bench engine --vllm-peer RUNNER` through RUNNER (e.g. ../shared/peers/vllm-cpu.sh,
which runs a script in vLLM's own venv): it imports only vLLM and the standard library. Reads the workload
(prompt token ids + output lengths) from a JSON file, prints one JSON line {"seconds", "tokens"}.
"""
import argparse
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--workload", required=True)
    args = parser.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    workload = json.load(open(args.workload))
    prompts = [TokensPrompt(prompt_token_ids=p) for p in workload["prompts"]]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)
              for n in workload["output_lens"]]
    llm = LLM(model=args.model, dtype="float32", gpu_memory_utilization=0.5, skip_tokenizer_init=True,
              max_model_len=2048, seed=0)
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print("PEER_RESULT " + json.dumps({"seconds": seconds, "tokens": tokens}), flush=True)


if __name__ == "__main__":
    main()
