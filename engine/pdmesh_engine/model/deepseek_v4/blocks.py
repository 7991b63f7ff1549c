"""DeepSeek-V4's per-token blocks: norms, the interleaved partial rope, the manifold-constrained
hyper-connections (mHC) around every block, and the MoE (hash or top-k routed, clamped SwiGLU).

What transformers keeps in fp32 stays fp32 here: the hyper-connections, the norms' weights, the
attention sinks, the compressors' position biases and the router's correction bias.

Legend: T tokens, N hc_mult streams, D hidden, H heads, R rope dims, K experts per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdmesh_engine.model.deepseek_v4.config import HASH_MOE, RopeSpec, V4Config
from pdmesh_engine.model.experts import swiglu
from pdmesh_engine.model.moe import (
    ExpertDispatcher,
    ExpertLoadRecorder,
    ExpertPlacement,
    LocalDispatcher,
    PlacedExperts,
)
from pdmesh_engine.model.rope import rope_inv_freq
from pdmesh_kernels import mhc_collapse_triton, mhc_expand_triton, uses_triton


class RMSNorm(nn.Module):
    """Weighted RMSNorm computed in fp32 (fp32 weight), returned in the input's dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps))).to(
            x.dtype
        )


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class Rope(nn.Module):
    """Interleaved rope on the trailing R channels of a head: pairs (x0, x1), (x2, x3), ... stay in
    place (the attention output is un-rotated with the same pairs, so the layout matters)."""

    def __init__(self, spec: RopeSpec) -> None:
        super().__init__()
        self.spec = spec
        self.register_buffer("inv_freq", torch.empty(spec.qk_rope_head_dim // 2), persistent=False)
        self.scaling = 1.0
        self.materialize()

    def materialize(self) -> None:
        """(Re)compute the table on the buffer's device (after a model was built on meta)."""
        with torch.device("cpu"):
            inv_freq, self.scaling = rope_inv_freq(self.spec)
        self.inv_freq = inv_freq.to(self.inv_freq.device)

    def tables(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [T, R/2] at `positions` [T], rounded to `dtype` (as the reference does)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return (freqs.cos() * self.scaling).to(dtype), (freqs.sin() * self.scaling).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, ..., C] with cos/sin [T, R/2]: rotate the last R channels (fp32 math), in x's dtype.
    Pass -sin to undo a rotation."""
    rope_dim = 2 * cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.float().view(shape), sin.float().view(shape)
    pairs = x[..., -rope_dim:].float().unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((x0 * c - x1 * s, x1 * c + x0 * s), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat((x[..., :-rope_dim], rotated), dim=-1)


class HyperConnection(nn.Module):
    """mHC around one block: from the N streams [T, N, D] compute (pre, post, comb); `pre`
    collapses the streams into the block's input, `expand` adds the block's output back as
    post * out + comb^T @ streams. comb is projected to doubly stochastic by Sinkhorn-Knopp."""

    def __init__(self, config: V4Config) -> None:
        super().__init__()
        n = config.hc_mult
        self.n, self.iters, self.eps, self.norm_eps = (
            n,
            config.hc_sinkhorn_iters,
            config.hc_eps,
            config.rms_norm_eps,
        )
        self.fn = nn.Parameter(
            torch.zeros((2 + n) * n, n * config.hidden_size, dtype=torch.float32)
        )
        self.base = nn.Parameter(torch.zeros((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, N, D] -> (block input [T, D], post [T, N], comb [T, N, N]) (fp32 weights).
        On CUDA (`uses_triton`): one Triton kernel (`pdmesh_kernels.v4_mhc`), the same math."""
        if uses_triton(streams.device):
            return mhc_collapse_triton(
                streams,
                self.fn.float(),
                self.base.float(),
                self.scale.float(),
                self.iters,
                self.eps,
                self.norm_eps,
            )
        n = self.n
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        mixes = F.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = (
            torch.softmax(comb_w.unflatten(-1, (n, n)) * comb_s + comb_b.view(n, n), dim=-1)
            + self.eps
        )
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return collapsed, post, comb

    @staticmethod
    def expand(
        streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        """New streams: post * out + comb^T @ streams. On CUDA (`uses_triton`): one Triton kernel
        (`pdmesh_kernels.v4_mhc`), which keeps post and comb in fp32."""
        if uses_triton(streams.device):
            return mhc_expand_triton(streams, out, post, comb)
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(
            comb.to(dtype).transpose(-1, -2), streams
        )


class HyperHead(nn.Module):
    """The final collapse of the N streams into one, before the norm and the head."""

    def __init__(self, config: V4Config) -> None:
        super().__init__()
        n = config.hc_mult
        self.eps, self.norm_eps = config.hc_eps, config.rms_norm_eps
        self.fn = nn.Parameter(torch.zeros(n, n * config.hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        pre = torch.sigmoid(F.linear(flat, self.fn.float()) * self.scale + self.base) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


class SharedExpert(nn.Module):
    def __init__(self, hidden: int, width: int, limit: float) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, width, bias=False)  # gate
        self.w3 = nn.Linear(hidden, width, bias=False)  # up
        self.w2 = nn.Linear(width, hidden, bias=False)  # down
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(torch.cat((self.w1(x), self.w3(x)), dim=-1), self.limit))


_SCORES = {
    "sqrtsoftplus": lambda x: F.softplus(x).sqrt(),
    "sigmoid": torch.sigmoid,
    "softmax": lambda x: x.softmax(dim=-1),
}


class Router(nn.Module):
    """Scores every expert; a top-k layer chooses by score + correction bias, a hash layer by the
    frozen `tid2eid[token id]`. The chosen scores, normalised, times `routed_scaling_factor`."""

    def __init__(self, config: V4Config, hashed: bool) -> None:
        super().__init__()
        e = config.n_routed_experts
        self.weight = nn.Parameter(torch.zeros(e, config.hidden_size, dtype=torch.float32))
        self.hashed, self.top_k = hashed, config.num_experts_per_tok
        if hashed:
            self.register_buffer(
                "tid2eid", torch.zeros(config.vocab_size, self.top_k, dtype=torch.int64)
            )
        else:
            self.bias = nn.Parameter(torch.zeros(e, dtype=torch.float32))
        self.score = _SCORES[config.scoring_func]
        self.norm, self.scaling = config.norm_topk_prob, config.routed_scaling_factor

    def forward(
        self, x: torch.Tensor, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> (weights [T, K] fp32, expert ids [T, K] int64)."""
        scores = self.score(F.linear(x.float(), self.weight.float()))
        if self.hashed:
            ids = self.tid2eid[input_ids]
        else:
            ids = torch.topk(scores + self.bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if self.norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids


class MoE(PlacedExperts):
    """Routed experts on this process's physical slots (w13 [P_local, 2I, D] = gate; up, w2
    [P_local, D, I]) plus the shared expert. As V3's (pdmesh_engine.model.moe): an
    `ExpertPlacement` maps the router's logical experts to slots and an `ExpertDispatcher` runs
    them (in this process, or the DEP all-to-all); by default every slot is here and slot e holds
    expert e. A hash layer's experts are ordinary experts whose choice the token id fixes, so each
    DEP rank routes its own tokens by their ids."""

    def __init__(
        self,
        config: V4Config,
        layer_id: int,
        placement: ExpertPlacement | None = None,
        dispatcher: ExpertDispatcher | None = None,
        local_slots: range | None = None,
    ) -> None:
        width, hidden = config.moe_intermediate_size, config.hidden_size
        if placement is None:
            placement = ExpertPlacement.initial(config.n_routed_experts)
        super().__init__(
            hidden,
            width,
            placement,
            dispatcher or LocalDispatcher(),
            range(placement.num_physical) if local_slots is None else local_slots,
            layer_id,  # every V4 layer is an MoE layer
        )
        self.gate = Router(config, config.mlp_layer_types[layer_id] == HASH_MOE)
        self.shared_experts = SharedExpert(hidden, width, config.swiglu_limit)
        self.limit = config.swiglu_limit

    def forward(
        self,
        x: torch.Tensor,
        input_ids: torch.Tensor,
        expert_load: ExpertLoadRecorder | None = None,
    ) -> torch.Tensor:
        """x [T, D] (the collapsed mHC state, normed), input_ids [T] -> [T, D]; with
        `expert_load`, the tokens routed to each slot are recorded there."""
        weights, ids = self.gate(x, input_ids)
        slot_ids = self.placement.choose_slots(ids)
        if expert_load is not None:
            expert_load.record(self.moe_index, slot_ids)
        routed = self.dispatcher(x, weights, slot_ids, self.w13, self.w2, swiglu_limit=self.limit)
        return routed + self.shared_experts(x)

    @torch.no_grad()
    def load_stacked(self, which: str, tensor: torch.Tensor) -> None:
        """Copy a tensor stacked over every logical expert (transformers' fused w13 [E, 2I, D] or
        w2 [E, D, I]) into the local slots, each slot its expert's rows."""
        experts = [self._slot_experts[slot] for slot in self.local_slots]
        target = self.w13 if which == "w13" else self.w2
        target.copy_(tensor[torch.tensor(experts, dtype=torch.int64, device=tensor.device)])
