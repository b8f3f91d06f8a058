"""TokenizerProcess: the token ids of a large text, written as a JSON list by a child process.

Building the Python list of the 2.6 million ids a 3.9 MB text has (the tokenizers library's Encoding.ids) holds
the GIL for ~65 ms in one C call, and freeing the list ~17 ms more: on whatever thread that runs, the event loop
waits for the GIL meanwhile, and so do the probes. /tokenize of a large text, the one request that needs the ids
of so long a text (a generation prompt past the context is refused from its count, prompt_encoder.py), is
tokenized here instead, in a child process with a GIL of its own: it encodes the text as PromptEncoder does (the
batch call without offsets), writes the ids as JSON and sends the bytes back; the front end copies them into its
answer without reading them.

The child is `python -m cluster.api.tokenize_process` (a plain subprocess: nothing of the server is imported or
inherited but this module and the tokenizer's JSON), started at the first call; it takes about a second to start
and tokenizes one text at a time, over its stdin and stdout: callers on several threads wait their turn. A child
found dead when a call starts is replaced; one that dies during a call makes that call raise RuntimeError, and is
replaced at the next. close() ends it.
"""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import threading

JOIN_TIMEOUT_S = 5.0
_REQUEST = struct.Struct("<QB")   # text bytes, add_special_tokens
_REPLY = struct.Struct("<BQQ")    # ok, count, payload bytes (the JSON list, or the exception's type name)
_LENGTH = struct.Struct("<Q")


class TokenizerProcess:
    """Tokenizes with the tokenizers library's Tokenizer of `tokenizer_json` (its to_str()) in a child process.
    Safe to call from several threads; close() when the front end stops."""

    def __init__(self, tokenizer_json: str) -> None:
        """Starts nothing: the child is started at the first call."""
        self._tokenizer_json = tokenizer_json.encode()
        self._lock = threading.Lock()
        self._child: subprocess.Popen | None = None
        self._closed = False

    def ids_json(self, text: str, add_special_tokens: bool) -> tuple[int, bytes]:
        """(number of tokens, their ids as a JSON list) of `text`; ValueError naming the tokenizer's exception type
        when it cannot take the text, RuntimeError when the child died or this was closed."""
        data = text.encode("utf-8")
        with self._lock:
            if self._closed:
                raise RuntimeError("the tokenizer process is closed")
            child = self._started()
            try:
                child.stdin.write(_REQUEST.pack(len(data), add_special_tokens) + data)
                child.stdin.flush()
                ok, count, size = _REPLY.unpack(_read(child.stdout, _REPLY.size))
                payload = _read(child.stdout, size)
            except (EOFError, OSError) as error:
                self._stop()
                raise RuntimeError(f"the tokenizer process died ({type(error).__name__}); it restarts at the next "
                                   "request") from error
        if not ok:
            raise ValueError(payload.decode())
        return count, payload

    def close(self) -> None:
        """Ends the child (waiting up to JOIN_TIMEOUT_S for it); later calls raise RuntimeError. Idempotent."""
        with self._lock:
            self._closed = True
            self._stop()

    def _started(self) -> subprocess.Popen:
        if self._child is not None and self._child.poll() is None:
            return self._child
        self._stop()
        path = os.pathsep.join(entry for entry in sys.path if entry)
        self._child = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": path})
        self._child.stdin.write(_LENGTH.pack(len(self._tokenizer_json)) + self._tokenizer_json)
        self._child.stdin.flush()
        return self._child

    def _stop(self) -> None:
        child, self._child = self._child, None
        if child is None:
            return
        for stream in (child.stdin, child.stdout):
            try:
                stream.close()  # the child reads the end of its input and returns
            except OSError:
                pass
        try:
            child.wait(JOIN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def _read(stream, size: int) -> bytes:
    """Exactly `size` bytes of `stream`; EOFError when it ends first."""
    data = stream.read(size)
    if len(data) != size:
        raise EOFError(f"expected {size} bytes, got {len(data)}")
    return data


def serve(reader, writer) -> None:
    """The child: reads the tokenizer's JSON, then answers each request (a text) with its ids as a JSON list, or
    the type name of what the tokenizer raised, until its input ends."""
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_str(_read(reader, _LENGTH.unpack(_read(reader, _LENGTH.size))[0]).decode())
        encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
        while True:
            size, add_special_tokens = _REQUEST.unpack(_read(reader, _REQUEST.size))
            text = _read(reader, size).decode("utf-8")
            try:
                ids = encode([text], add_special_tokens=bool(add_special_tokens))[0].ids
            except Exception as error:  # the tokenizers library raises TypeError and bare Exceptions on odd text
                name = type(error).__name__.encode()
                writer.write(_REPLY.pack(False, 0, len(name)) + name)
            else:
                payload = json.dumps(ids, separators=(",", ":")).encode()
                writer.write(_REPLY.pack(True, len(ids), len(payload)) + payload)
            writer.flush()
    except EOFError:
        return


if __name__ == "__main__":
    serve(sys.stdin.buffer, sys.stdout.buffer)
