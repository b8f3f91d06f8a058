"""`tandem convert model.gguf out_dir/`: a GGUF checkpoint as a Hugging Face checkpoint directory
(engine.convert.convert_gguf), so a peer (transformers, vLLM) can be measured on the same weights."""
from __future__ import annotations

import argparse
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("gguf", help="the GGUF file")
    parser.add_argument("out_dir", help="the directory to write (created; files of the same names overwritten)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="the weights' dtype (float32: the dequantized values exactly)")


def run(args: argparse.Namespace) -> int:
    """Write the checkpoint; ValueError (exit 2) for a file that is not a GGUF checkpoint Tandem loads."""
    from engine.convert import convert_gguf
    started = time.perf_counter()
    out = convert_gguf(args.gguf, args.out_dir, args.dtype)
    files = sorted(path.name for path in out.iterdir() if path.is_file())
    print(f"wrote {out} ({', '.join(files)}) in {time.perf_counter() - started:.1f}s")
    return 0
