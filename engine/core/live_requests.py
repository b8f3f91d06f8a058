"""The engine's live requests: the samples (sequences) of each request id still in the engine, and the output
text each sample is building. Owned by LLMEngine; one thread uses it."""
from __future__ import annotations

from engine.outputs import OutputText
from engine.sequence import Sequence


class LiveRequests:
    """Request id -> its live samples (in sample order), and sample -> its OutputText."""

    def __init__(self) -> None:
        self._samples: dict[str, list[Sequence]] = {}
        self._texts: dict[Sequence, OutputText] = {}

    def add(self, seq: Sequence, text: OutputText) -> None:
        self._samples.setdefault(seq.request_id, []).append(seq)
        self._texts[seq] = text

    def remove(self, seq: Sequence) -> OutputText:
        """A sample that ended leaves; with the request's last, its id becomes reusable. Returns its text."""
        samples = self._samples[seq.request_id]
        samples.remove(seq)
        if not samples:
            del self._samples[seq.request_id]
        return self._texts.pop(seq)

    def text(self, seq: Sequence) -> OutputText:
        return self._texts[seq]

    def samples(self, request_id: str) -> list[Sequence]:
        """A copy of the request's live samples (empty when it has none)."""
        return list(self._samples.get(request_id, ()))

    def first(self, request_id: str) -> Sequence | None:
        """The first still live sample of the request, if any."""
        samples = self._samples.get(request_id)
        return samples[0] if samples else None

    def request_ids(self) -> list[str]:
        return list(self._samples)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._samples

    def __len__(self) -> int:
        return len(self._samples)
