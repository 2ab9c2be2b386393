"""CFG and batch groups trade sequence shards of the transformer's output, not the whole output.

On 2 nodes x 2 ranks with `c2u2` the two CFG groups span the nodes and each Ulysses group sits
inside one: the batch is gathered across the nodes on each rank's sequence shard, then the
sequence inside the node (engine/data_parallel.py). So the data exchange crosses the nodes with the
whole output's bytes once in all (each rank its shard of its share), half of what trading whole
shares sent, and the sequence gather never leaves a node.
"""

import torch
from conftest import RANK_TIMEOUT_S
from model_cases import forward_inputs

from cocodiff import ParallelConfig
from cocodiff.run.launch import spawn
from cocodiff.models.presets import load_pipeline

MODELS = ["tiny-sd3", "tiny-flux"]
"""SD3 unpatchifies after `proj_out` (its batch dim shapes the result); FLUX returns its output."""

# fp32: sharded attention sums keys in another order than one process (~1e-7 relative per
# operation); 1e-4 of the output's magnitude leaves room for that over the layers (as in
# test_models.py), while a misplaced batch item or token differs by order 1e-1.
RTOL_OF_SCALE = 1e-4


def forward_with_bytes(models: list[str]) -> dict[str, dict]:
    """One batch-2 forward per model under c2u2 on 2 nodes x 2 ranks: output and bytes sent."""
    from cocodiff import parallelize

    runs = {}
    for model in models:
        pipe, _ = load_pipeline(model, seed=0)
        parallel = parallelize(pipe.transformer, ParallelConfig(plan="c2u2", ranks_per_node=2))
        with torch.no_grad():
            out = pipe.transformer(**forward_inputs(model, pipe.transformer), return_dict=False)[0]
        stats = parallel.stats
        runs[model] = {
            "out": out,
            "links": {
                kind: (stats.other_node_bytes[kind], stats.same_node_bytes[kind]) for kind in ("data", "gather")
            },
        }
    return runs


def test_data_groups_send_sequence_shards_across_nodes():
    ranks = spawn(forward_with_bytes, 4, MODELS, timeout_s=RANK_TIMEOUT_S)
    for model in MODELS:
        pipe, _ = load_pipeline(model, seed=0)
        with torch.no_grad():
            reference = pipe.transformer(**forward_inputs(model, pipe.transformer), return_dict=False)[0]
        whole = reference.numel() * reference.element_size()  # the call's output, batch of 2
        data_inter, data_intra = (sum(r[model]["links"]["data"][i] for r in ranks) for i in (0, 1))
        gather_inter, gather_intra = (sum(r[model]["links"]["gather"][i] for r in ranks) for i in (0, 1))
        # Every rank sends its (1, S_r, C) shard to its CFG peer on the other node: the whole
        # output once in all (whole shares would be twice: each rank its (1, S, C)).
        assert (data_inter, data_intra) == (whole, 0), model
        # Each rank sends its (2, S_r, C) shard of the whole batch to its Ulysses peer in the node,
        # padded to the longer shard (8 of the 15 image tokens).
        assert (gather_inter, gather_intra) == (0, 4 * 8 * whole // 15), model
        scale = reference.abs().max()
        for r in ranks:
            assert (r[model]["out"] - reference).abs().max() <= RTOL_OF_SCALE * scale, model
