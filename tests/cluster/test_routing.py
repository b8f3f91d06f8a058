"""The Router's accounting and policies, without Ray: decode order, prefill choice with prefix affinity,
dead workers, and the prefill queue's admission bound."""
from __future__ import annotations

from cluster.coordinator.routing import Router


def router() -> Router:
    return Router(["prefill-0", "prefill-1"], {"decode-0": 10, "decode-1": 20}, block_size=4)


def test_decode_order_prefers_free_blocks_and_skips_the_dead():
    r = router()
    assert r.decode_order() == ["decode-1", "decode-0"]
    r.claim_decode("decode-1", 15)
    assert r.decode_order() == ["decode-0", "decode-1"]
    assert r.mark_dead("decode-0") and not r.mark_dead("decode-0")
    assert r.decode_order() == ["decode-1"] and r.alive_counts() == (2, 1)


def test_prefill_queue_bound_refuses_only_while_every_queue_would_pass_it():
    r = router()
    assert r.prefill_refusal(5000, max_queue_tokens=1000) is None   # empty queues: even an oversize prompt
    r.claim_prefill("prefill-0", 800)
    assert r.prefill_refusal(300, 1000) is None                    # prefill-1 is still empty
    r.claim_prefill("prefill-1", 600)
    assert r.prefill_refusal(400, 1000) is None                    # 600 + 400 fits on prefill-1
    refusal = r.prefill_refusal(401, 1000)
    assert refusal is not None and "1000" in refusal
    assert r.prefill_refusal(10 ** 6, 0) is None                   # 0: no bound
    r.prefill_done("prefill-1", 600)
    assert r.prefill_refusal(401, 1000) is None
    r.mark_dead("prefill-1")                                       # only prefill-0's queue counts now
    assert r.prefill_refusal(201, 1000) is not None


def test_prefix_affinity_sends_a_shared_first_block_to_the_same_prefill_worker():
    r = router()
    first = r.pick_prefill((1, 2, 3, 4, 5, 6))
    r.claim_prefill(first, 6)
    assert r.pick_prefill((1, 2, 3, 4, 9)) == first                # same first block, within the slack
    assert r.pick_prefill((7, 7, 7, 7, 7)) != first                # another prefix: the shorter queue
