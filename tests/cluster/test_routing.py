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


def replicas(slack_tokens: int = 100, slack_requests: int = 2) -> Router:
    return Router([], {"replica-0": 50, "replica-1": 50}, block_size=4, affinity_slack_tokens=slack_tokens,
                  affinity_slack_requests=slack_requests)


def test_replicas_go_by_load_in_tokens_then_free_blocks():
    r = replicas()
    assert r.alive_counts() == (0, 2) and r.replica_order((1, 2, 3), blocks=2) == ["replica-0", "replica-1"]
    r.claim_decode("replica-0", 2, queued_tokens=30)         # a 30-token prompt waits on replica-0
    assert r.replica_order((9,), 2) == ["replica-1", "replica-0"]
    for _ in range(32):                                        # 32 decoding requests outweigh 30 waiting tokens
        r.claim_decode("replica-1", 1)
    assert r.replica_order((9,), 2) == ["replica-0", "replica-1"]
    r.prefilled("replica-0", 30)                               # its first token came: 1 running vs 32
    assert r.replica_order((9,), 2)[0] == "replica-0"
    tight = replicas()
    tight.claim_decode("replica-0", 40)                        # least loaded (1 running), 10 blocks free
    for _ in range(3):
        tight.claim_decode("replica-1", 1)                     # 3 running, 47 blocks free
    assert tight.replica_order((9,), blocks=5) == ["replica-0", "replica-1"]
    assert tight.replica_order((9,), blocks=20) == ["replica-1", "replica-0"]  # replica-0 cannot hold 20


def test_replica_prefix_affinity_holds_within_the_slack_then_spills_and_both_hold_it():
    r = replicas(slack_tokens=100, slack_requests=2)
    shared = tuple(range(1, 13))                               # 3 blocks of 4
    r.claim_decode("replica-1", 1)                             # replica-1 busier: the first goes to replica-0 ...
    r.served_prefix(shared + (50,), "replica-1")               # ... unless replica-1 served the prefix
    assert r.replica_order(shared + (60, 61), 2)[0] == "replica-1"
    assert r.replica_order((7, 7, 7, 7, 7, 7), 2)[0] == "replica-0"   # another prefix: least loaded
    assert r.replica_order(shared[:4] + (99,) * 8, 2)[0] == "replica-1"  # one shared block is enough
    r.claim_decode("replica-1", 1)
    r.claim_decode("replica-1", 1)                             # 3 running vs 0: past the 2-request slack
    assert r.replica_order(shared + (60,), 2)[0] == "replica-0"
    r.served_prefix(shared + (60,), "replica-0")               # the spill: replica-0 holds it too now
    r.claim_decode("replica-0", 1, queued_tokens=150)          # and is past the token slack
    assert r.replica_order(shared + (70,), 2)[0] == "replica-1"  # least loaded holder within the slack
    assert r.mark_dead("replica-1") and r.replica_order(shared + (70,), 2) == ["replica-0"]


def test_the_block_of_the_last_token_is_no_prefix():
    r = replicas()
    r.claim_decode("replica-0", 1)
    r.served_prefix((1, 2, 3, 4), "replica-0")                 # one block, and it holds the last token
    assert r.replica_order((1, 2, 3, 4, 5), 2)[0] == "replica-1"


def kv_aware(weight: float = 2.0) -> Router:
    return Router(["prefill-0"], {"decode-0": 100, "decode-1": 100, "decode-2": 100}, block_size=4,
                  kv_overlap_weight=weight)


def test_kv_aware_decode_order_prefers_the_longest_prefix_unless_overloaded():
    r = kv_aware()
    chat = tuple(range(1, 41))                                      # 10 blocks of 4
    assert r.decode_order(chat, 12) == ["decode-0", "decode-1", "decode-2"]   # nothing known: by load
    r.decode_holds(chat[:17], "decode-1")                            # 4 blocks (not the last token's)
    r.decode_holds(chat[:33], "decode-2")                            # 8 blocks
    assert r.decode_order(chat + (7,), 12) == ["decode-2", "decode-1", "decode-0"]
    assert r.decode_order((9,) * 40, 12) == ["decode-0", "decode-1", "decode-2"]  # another prompt: by load
    r.claim_decode("decode-2", 7)          # cost 2*(11-8) - 93 = -87 vs decode-1's 2*(11-4) - 100 = -86
    assert r.decode_order(chat + (7,), 12)[0] == "decode-2"
    r.claim_decode("decode-2", 2)          # 9 blocks claimed: -85 > -86, the load outweighs the longer prefix
    assert r.decode_order(chat + (7,), 12)[:2] == ["decode-1", "decode-2"]
    assert r.mark_dead("decode-2") and r.decode_order(chat + (7,), 12) == ["decode-1", "decode-0"]
    heavy = kv_aware(weight=100.0)
    heavy.decode_holds(chat, "decode-1")   # 9 of the 11 blocks: by cost decode-1 wins by far ...
    heavy.claim_decode("decode-1", 95)     # ... but with 5 free blocks it cannot hold the request's 12: last
    assert heavy.decode_order(chat + (7,), 12) == ["decode-0", "decode-2", "decode-1"]


def test_decode_order_ignores_prefixes_without_kv_aware_routing():
    r = Router(["prefill-0"], {"decode-0": 100, "decode-1": 100}, block_size=4)
    r.decode_holds(tuple(range(40)), "decode-1")
    assert r.decode_order(tuple(range(41)), 12) == ["decode-0", "decode-1"]
    weightless = kv_aware(weight=0.0)
    weightless.decode_holds(tuple(range(40)), "decode-1")
    assert weightless.decode_order(tuple(range(41)), 12)[0] == "decode-0"
