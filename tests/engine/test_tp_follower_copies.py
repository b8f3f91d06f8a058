"""A tensor-parallel follower's step (engine/runner/tp_follower.py FollowerRunner.run) puts everything it needs on
the device in one host-to-device copy, counted by its StepIO: prefill, decode (eager, or through the decode graphs'
staged inputs) and mixed steps with prompt-logprob rows alike. The follower here is a FollowerRunner in this process
over the one-rank model with a KV pool of its own, fed the message rank 0's runner sends for every step of a TP=1
engine (ModelRunner.step_sender, which TPLeader.send_step is on a real group): the logits of its sampled rows pick
transformers' tokens. FollowerTables (the follower's device block table, kept from the messages' whole tables) is
checked against the tables it is given."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from engine import SamplingParams
from engine.attention.backends import triton_available
from engine.attention.metadata import padded_tables
from engine.kv.kv_cache import KVCache
from engine.parallel.step_message import StepInputs
from engine.runner.decode_graphs import DecodeGraphs
from engine.runner.follower_inputs import FollowerInputs, FollowerTables
from engine.runner.tp_follower import FollowerRunner
from engine.step_io import StepIO
from tests.support.engine_checks import assert_all_blocks_free, random_prompts
from tests.support.engines import TEST_DEVICE, make_llm

MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


@dataclass
class Followed:
    """What the follower did, step by step: its host-to-device copies, the step's kind, its greedy picks with the
    request each goes to (rank 0's order of sampled sequences)."""

    copies: list[int] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)     # "prefill", "decode" (single-token rows only), "mixed"
    prompt_rows: list[int] = field(default_factory=list)
    picks: list[list[int]] = field(default_factory=list)
    owners: list[list[str]] = field(default_factory=list)

    def tokens(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for picks, owners in zip(self.picks, self.owners, strict=True):
            for token, owner in zip(picks, owners, strict=True):
                out.setdefault(owner, []).append(token)
        return out


def _kind(step: StepInputs) -> str:
    single = [n == 1 for n in step.num_new]
    return "decode" if all(single) else "mixed" if any(single) else "prefill"


def attach_follower(engine, graphs: bool, num_rows: int = 2) -> tuple[FollowerRunner, Followed]:
    """A follower running every step of the engine's runner (its block table first smaller than the steps need,
    so that it grows); with graphs, decode graphs (uncaptured) of its own."""
    runner, spec, followed = engine.runner, engine.kv_cache.spec, Followed()
    kv_cache = KVCache(spec, engine.kv_cache.num_blocks, runner.device, enable_prefix_caching=False)
    io = StepIO(runner.device)
    decode_graphs = DecodeGraphs(runner.model, kv_cache, runner.attention, max_num_seqs=4,
                                 max_model_len=engine.max_model_len, device=runner.device, capture=False,
                                 io=io) if graphs else None
    inputs = FollowerInputs(runner.attention, spec.block_size, runner.device, io, decode_graphs, num_rows=num_rows,
                            max_blocks=2)
    follower = FollowerRunner(runner.model, kv_cache, inputs, None, engine.model_config)
    stage = inputs.stage

    def stage_and_check(step: StepInputs):  # the prompt-logprob rows cross intact (the picks check the rest)
        staged = stage(step)
        assert ([] if staged.prompt_rows is None else staged.prompt_rows.tolist()) == list(step.prompt_rows)
        return staged

    def follow(step: StepInputs) -> None:
        io.copies.reset()
        logits = follower.run(step)  # [S, vocab]
        followed.copies.append(io.copies.host_to_device)
        followed.kinds.append(_kind(step))
        followed.prompt_rows.append(len(step.prompt_rows))
        followed.picks.append([] if logits is None else logits.argmax(dim=-1).tolist())

    def launch(*args, **kwargs):
        launched = rank0_launch(*args, **kwargs)
        followed.owners.append([seq.request_id for seq in launched.seqs])
        return launched

    inputs.stage, rank0_launch, runner.launch, runner.step_sender = stage_and_check, runner.launch, launch, follow
    return follower, followed


def _run_all(engine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    return tokens


def test_follower_prefill_decode_and_mixed_steps_upload_once(tiny_checkpoint, hf_greedy):
    path = tiny_checkpoint("llama")
    with make_llm(str(path), device="cpu", block_size=4, async_scheduling=False) as llm:
        engine = llm.engine
        follower, followed = attach_follower(engine, graphs=False)
        prompts = random_prompts([5, 9, 14], llm.get_tokenizer().vocab_size, seed=3)
        for i, prompt in enumerate(prompts[:2]):
            engine.add_request(f"r{i}", prompt, GREEDY)
        tokens = {}
        for _ in range(3):  # the prefill, then decodes (a block every 4 tokens)
            for delta in engine.step():
                tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
        engine.add_request("r2", prompts[2], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                                                            prompt_logprobs=2))
        for request, got in _run_all(engine).items():
            tokens.setdefault(request, []).extend(got)
        assert followed.kinds[:4] == ["prefill", "decode", "decode", "mixed"]
        assert followed.prompt_rows[3] == len(prompts[2]) - 1  # the mixed step's prompt-logprob rows
        assert followed.copies == [1] * len(followed.kinds)
        want = hf_greedy(path, prompts, MAX_TOKENS)
        assert followed.tokens() == {f"r{i}": want[i] for i in range(3)} == tokens
        assert_all_blocks_free(llm)
        follower.close()


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_follower_graph_decode_steps_upload_once(tiny_checkpoint, hf_greedy):
    """Decode graphs uncaptured (their staged inputs and replay path, eagerly): the follower's decode steps go
    through DecodeGraphs.run_staged in one upload, only the tables' new blocks in it."""
    path = tiny_checkpoint("qwen2")
    with make_llm(str(path), dtype="float32", device=TEST_DEVICE.type, attention_backend="triton", max_num_seqs=4,
                  block_size=4, async_scheduling=False, max_num_batched_tokens=64, max_model_len=64) as llm:
        engine = llm.engine
        follower, followed = attach_follower(engine, graphs=True, num_rows=4)
        replayed = []
        run_staged = follower.inputs.graphs.run_staged
        follower.inputs.graphs.run_staged = lambda batch, *rest: replayed.append(len(batch.updates)) or \
            run_staged(batch, *rest)
        prompts = random_prompts([3, 6, 11], llm.get_tokenizer().vocab_size, seed=4)
        few = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)  # each row crosses into a new block
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, few)
        tokens = _run_all(engine)
        steps = 5  # one prefill step, then 4 decode steps
        assert followed.kinds == ["prefill"] + ["decode"] * (steps - 1)
        assert followed.copies == [1] * steps
        assert len(replayed) == steps - 1 and 0 < sum(replayed) < 3 * (steps - 1)  # only new blocks travel
        want = hf_greedy(path, prompts, 5)
        assert followed.tokens() == {f"r{i}": want[i] for i in range(3)} == tokens
        assert_all_blocks_free(llm)
        follower.close()


def _step_tables(tables: FollowerTables, seqs: list[list[int]], lens: list[int], block_size: int) -> int:
    """Plans and applies one step's tables (each sequence's blocks, 0-padded); checks that every row reads its
    sequence's blocks; returns the number of entries sent."""
    message = padded_tables(seqs)  # [N, width]
    rows, updates = tables.plan(message, lens, block_size)
    device = tables.device_tables
    blocks = torch.tensor(updates.blocks, dtype=torch.int32)
    device.apply(torch.tensor(updates.rows, dtype=torch.int64), torch.tensor(updates.cols, dtype=torch.int64), blocks)
    got = device.gather(torch.tensor(rows), message.shape[1]).numpy()  # [N, width]
    for i, length in enumerate(lens):
        used = -(-length // block_size)
        assert np.array_equal(got[i, :used], message[i, :used])
    assert len(set(rows)) == len(rows)
    return len(updates)


def test_follower_tables_hold_each_steps_tables_and_send_only_what_changed():
    """Random steps over sequences that grow, finish (their blocks reused by others), join, reorder and sometimes
    hold a block ahead: every row reads its sequence's blocks; a decode step of the last step's sequences, in any
    order, sends at most one entry per sequence that moved into a new block."""
    rng, block_size, free = random.Random(0), 4, list(range(200))
    rng.shuffle(free)
    tables = FollowerTables(torch.device("cpu"), num_rows=2, max_blocks=2)  # grown on the way
    live: list[tuple[list[int], list[int]]] = []  # (blocks, [length]) per sequence
    sent_by_decodes = 0
    for step in range(60):
        decode = step % 10 != 0
        if decode:
            for _, length in live:
                length[0] += 1
        else:  # some finish, some join with a prompt of 1..12 tokens
            for seq in rng.sample(live, k=len(live) // 3):
                live.remove(seq)
                free += seq[0]
            live += [([], [rng.randint(1, 12)]) for _ in range(rng.randint(1, 3))]
        for blocks, length in live:
            needed = -(-length[0] // block_size) + (rng.random() < 0.2)  # sometimes one block ahead
            while len(blocks) < needed:
                blocks.append(free.pop())
        rng.shuffle(live)
        sent = _step_tables(tables, [b for b, _ in live], [n[0] for _, n in live], block_size)
        if decode:
            moved = sum((n[0] - 1) % block_size == 0 for _, n in live)  # its new token starts a block
            assert sent <= moved
            sent_by_decodes += sent
    assert sent_by_decodes > 0
