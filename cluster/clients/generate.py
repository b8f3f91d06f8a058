"""`tandem client "prompt"` (or `python -m cluster.clients.generate`): stream one completion from a Tandem gRPC
server to the terminal, then print the request's timing breakdown. With `--n N`, the N samples' texts
and timings are printed as each sample ends (their tokens arrive interleaved)."""
from __future__ import annotations

import argparse
import sys

import grpc

from proto import tandem_pb2, tandem_pb2_grpc


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt text")
    parser.add_argument("--target", default="127.0.0.1:50051", help="host:port of the gRPC front end")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--n", type=int, default=1, help="samples of the prompt (seed + j for sample j)")
    parser.add_argument("--api-key", default=None)


def build_request(args: argparse.Namespace) -> tandem_pb2.GenerateRequest:
    optional = {k: v for k, v in (("top_p", args.top_p), ("top_k", args.top_k), ("seed", args.seed))
                if v is not None}
    return tandem_pb2.GenerateRequest(prompt=args.prompt, max_tokens=args.max_tokens, n=args.n,
                                      temperature=args.temperature, ignore_eos=args.ignore_eos, **optional)


def run(args: argparse.Namespace) -> int:
    metadata = [("authorization", f"Bearer {args.api_key}")] if args.api_key else None
    texts: dict[int, str] = {}
    with grpc.insecure_channel(args.target) as channel:
        stub = tandem_pb2_grpc.TandemStub(channel)
        try:
            for response in stub.Generate(build_request(args), metadata=metadata):
                texts[response.index] = texts.get(response.index, "") + response.text
                if args.n == 1:
                    sys.stdout.write(response.text)
                    sys.stdout.flush()
                if response.finish_reason:
                    if args.n > 1:
                        print(f"--- sample {response.index} ---\n{texts[response.index]}")
                    print(_timing_line(response))
        except grpc.RpcError as error:
            print(f"\ntandem client: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
    return 0


def _timing_line(last: tandem_pb2.GenerateResponse) -> str:
    t = last.timing
    return (f"\n[{last.finish_reason}] ttft {t.ttft_ms:.1f} ms (queue {t.queue_ms:.1f}, prefill "
            f"{t.prefill_ms:.1f}, transfer {t.transfer_ms:.1f} ms of which {t.transfer_exposed_ms:.1f} after the "
            f"prefill, {t.kv_bytes} KV bytes) "
            f"prefill={t.prefill_worker or '-'} decode={t.decode_worker or '-'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem client", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
