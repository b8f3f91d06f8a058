"""The KV transfer `tandem plan` assumes when no --transfer-gbps is given: measured here by `tandem bench transfer`
(its JSON read back), a line through its two sizes."""
from cluster.plan.transfer_model import MEASURE_SIZES_MIB, measured_transfer


def test_the_transfer_is_measured_with_the_transfer_bench():
    model = measured_transfer(bytes_per_block=1 << 16, block_size=16, transport="gloo")
    assert model.bytes_per_second > 0 and model.latency_s >= 0
    assert model.source.startswith("measured: gloo") and f"{MEASURE_SIZES_MIB[-1]} MiB" in model.source
