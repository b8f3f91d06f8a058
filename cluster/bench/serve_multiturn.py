"""`--dataset-name multiturn` of `tandem bench serve` / `bench compare`: chats, and what their later turns cost.

Each conversation is a task: its turns go one after the other, turn k's prompt being the conversation so far
(the earlier user messages and the answers the server actually streamed, as token ids) plus message k;
conversations start on the arrival schedule and run concurrently (at most --max-concurrency at once). A turn
that fails ends its conversation (the next prompt would need its answer). The report adds, per turn after the
first: the prompt tokens, the KV bytes moved (tandem_timing.kv_bytes), the prompt tokens the decode worker
already held (decode_cached_tokens) and how many were prefilled on the decode worker (prefill_location).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time

import aiohttp
import numpy as np

from cluster.bench.serve_client import ClientConfig, send_request, served_model
from cluster.bench.serve_metrics import RequestResult
from cluster.bench.serve_workloads import Conversation, SampleRequest


async def _converse(session: aiohttp.ClientSession, config: ClientConfig, model: str,
                    conversation: Conversation) -> list[RequestResult]:
    history: tuple[int, ...] = ()
    results = []
    for turn, message in enumerate(conversation.messages, start=1):
        prompt = history + message
        result = await send_request(session, config, model, SampleRequest(prompt, conversation.output_len))
        results.append(dataclasses.replace(result, turn=turn))
        if not result.success:
            break
        history = prompt + result.output_token_ids
    return results


async def run_conversations(config: ClientConfig, conversations: list[Conversation], gaps: list[float],
                            warmups: list[SampleRequest]) -> tuple[str, list[RequestResult], float]:
    """Sends `warmups` (unmeasured, all at once), then starts conversation i after gaps[i] (cumulative), at
    most max_concurrency conversations at once. Returns (model, every turn's result in conversation
    order, duration of the measured part)."""
    timeout = aiohttp.ClientTimeout(total=config.timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        listed = await served_model(session, config.base_url)
        model = config.model or listed
        await asyncio.gather(*(send_request(session, config, model, sample) for sample in warmups))
        limit = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None

        async def limited(conversation: Conversation) -> list[RequestResult]:
            async with limit if limit else contextlib.nullcontext():
                return await _converse(session, config, model, conversation)

        start, tasks = time.perf_counter(), []
        for conversation, gap in zip(conversations, gaps):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(limited(conversation)))
        per_conversation = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return model, [result for results in per_conversation for result in results], duration


@dataclasses.dataclass(frozen=True)
class MultiturnSummary:
    """Means over successful turns: first turns, and turns after the first ("later")."""

    conversations: int
    first_turns: int
    later_turns: int
    first_kv_bytes: float
    later_kv_bytes: float
    later_prompt_tokens: float
    later_cached_tokens: float
    later_local: int          # later turns prefilled on their decode worker

    @classmethod
    def of(cls, results: list[RequestResult]) -> "MultiturnSummary | None":
        """None when no result is a conversation's turn."""
        done = [r for r in results if r.turn and r.success]
        if not any(r.turn for r in results):
            return None
        first, later = [r for r in done if r.turn == 1], [r for r in done if r.turn > 1]
        timing = lambda rs, key: float(np.mean([(r.timing or {}).get(key, 0) for r in rs])) if rs else 0.0  # noqa: E731
        return cls(sum(1 for r in results if r.turn == 1), len(first), len(later), timing(first, "kv_bytes"),
                   timing(later, "kv_bytes"), float(np.mean([r.prompt_len for r in later])) if later else 0.0,
                   timing(later, "decode_cached_tokens"),
                   sum(1 for r in later if (r.timing or {}).get("prefill_location") == "local"))

    def rows(self) -> list[tuple[str, object, str]]:
        """(label, value, format) for the text report."""
        return [("Conversations:", self.conversations, ""), ("Turns after the first:", self.later_turns, ""),
                ("Mean KV bytes, first turns:", self.first_kv_bytes, ".0f"),
                ("Mean KV bytes per turn after the first:", self.later_kv_bytes, ".0f"),
                ("Mean prompt tokens after the first:", self.later_prompt_tokens, ".1f"),
                ("Mean decode-cached tokens after first:", self.later_cached_tokens, ".1f"),
                ("Later turns prefilled locally:", self.later_local, "")]


def format_multiturn(summary: MultiturnSummary) -> str:
    title = "{s:{c}^{n}}".format(s="Multi-turn", n=50, c="-")
    return "\n".join([title] + ["{:<40} {:<10{}}".format(label, value, fmt) for label, value, fmt in summary.rows()])


GOAL_LATER_TURN_BYTES_RATIO = 0.25
NO_REUSE_SUFFIX = "-noreuse"


def multiturn_markdown(runs: list) -> list[str]:
    """For `bench compare` (runs: compare_report.ModeRun): one row per multiturn run, and each mode's KV bytes
    per turn after the first against its `-noreuse` twin at the same rate (what sending the whole prompt
    costs), with the goal (<= 25%). Empty when no run is multiturn."""
    summaries = [(run, MultiturnSummary.of(run.results)) for run in runs]
    summaries = [(run, summary) for run, summary in summaries if summary is not None]
    if not summaries:
        return []
    lines = ["| mode | rate | conversations | turns after the first | mean prompt tokens | mean KV bytes per "
             "later turn | decode-cached tokens | prefilled locally |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {run.mode} | {run.rate:g} | {s.conversations} | {s.later_turns} | {s.later_prompt_tokens:.1f} | "
              f"{s.later_kv_bytes:.0f} | {s.later_cached_tokens:.1f} | {s.later_local} |" for run, s in summaries]
    lines.append("")
    by_key = {(run.mode, run.rate): summary for run, summary in summaries}
    for run, summary in summaries:
        whole = by_key.get((run.mode + NO_REUSE_SUFFIX, run.rate))
        if whole is None or not whole.later_kv_bytes:
            continue
        ratio = summary.later_kv_bytes / whole.later_kv_bytes
        verdict = "met" if ratio <= GOAL_LATER_TURN_BYTES_RATIO else "NOT met"
        lines.append(f"- rate {run.rate:g}, {run.mode}: KV bytes per turn after the first {summary.later_kv_bytes:.0f}"
                     f" = {100 * ratio:.1f}% of the whole prompt's ({run.mode}{NO_REUSE_SUFFIX}: "
                     f"{whole.later_kv_bytes:.0f}); goal <= {100 * GOAL_LATER_TURN_BYTES_RATIO:.0f}%: {verdict}")
    return lines + [""]
