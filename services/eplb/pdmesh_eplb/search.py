"""The planner's construction and local search: replica counts, packing replicas onto ranks without
co-location, and the hottest-rank moves and swaps that refine a placement (from scratch or from the
previous one within a move budget). Pure numpy, vectorised over layers.

Legend: L layers, M MoE (non-zero) layers, E logical experts, P slots, R ranks, C = P / R slots per
rank, N nodes, n active layers, T hot ranks and K partner ranks examined per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_REL_EPS = 1e-4  # a move must gain this fraction of the mean rank load per rewritten slot
_SPREAD_WEIGHT = 0.002  # one more node spanned by an expert costs this fraction of the mean load
_NODE_SLACK = 0.002  # node-aware layers may trail the flat plan's balancedness by this much

Moves = tuple[np.ndarray, np.ndarray, np.ndarray]  # (layer, slot a, slot b) per candidate move


def _replica_counts(w: np.ndarray, num_slots: int, cap: int) -> np.ndarray:
    """Replicas per expert [M, E] summing to P, each in [1, cap]: the next replica always goes to
    the expert with the highest load per replica (minimises the heaviest replica)."""
    counts = np.ones(w.shape, dtype=np.int64)
    rows = np.arange(len(w))
    for _ in range(num_slots - w.shape[1]):
        counts[rows, np.where(counts < cap, w / counts, -1.0).argmax(1)] += 1
    return counts


def _fit_counts(w: np.ndarray, num_slots: int, num_ranks: int) -> tuple[np.ndarray, np.ndarray]:
    """Counts [M, E] for heavy skew: split each expert only as far as needed to fit under the mean
    rank load (ceil(w / mean), at most R), so a hot expert keeps few big replicas and leaves whole
    ranks to the rest; spare slots go to the lightest experts per replica (fillers). Also returns
    the rows [M] where that fits in P slots (counts of other rows are meaningless)."""
    counts = np.clip(np.ceil(w * num_ranks / w.sum(1, keepdims=True) - 1e-9), 1, num_ranks)
    counts = counts.astype(np.int64)
    fits = counts.sum(1) <= num_slots
    rows = np.arange(len(w))[:, None]
    while (spare := np.where(fits, num_slots - counts.sum(1), 0)).any():
        per_replica = np.where(counts < num_ranks, w / counts, np.inf)
        order = np.argsort(per_replica, axis=1, kind="stable")
        counts[rows, order] += (np.arange(w.shape[1]) < spare[:, None]) & (
            per_replica[rows, order] < np.inf
        )
    return counts, fits


def _pairing_bound(w: np.ndarray, counts: np.ndarray, num_ranks: int) -> np.ndarray:
    """Pigeonhole lower bound [M] on the peak rank load for these counts: of the R + 1 (2R + 1)
    heaviest replicas, two (three) share a rank."""
    sizes = np.repeat((w / counts).ravel(), counts.ravel()).reshape(len(w), -1)
    sizes = -np.sort(-sizes, axis=1)
    bound = sizes[:, 0]
    for k in (1, 2):
        if sizes.shape[1] > k * num_ranks:
            bound = np.maximum(bound, sizes[:, k * num_ranks - k : k * num_ranks + 1].sum(1))
    return bound


def _pack(
    w: np.ndarray, counts: np.ndarray, num_ranks: int, avoid_colocation: bool, num_nodes: int = 1
) -> np.ndarray:
    """Greedy packing [M, P]: replicas heaviest-first, each to the least-loaded rank with a free
    slot (with `avoid_colocation`: one without that expert if any; `_repair` fixes the rest).
    With N > 1, an expert's later replicas go to its first replica's node when a rank there is
    within one replica's load of the best rank. A loop over P replicas, vectorised over layers."""
    num_layers, num_experts = w.shape
    num_slots = int(counts[0].sum())
    per_rank = num_slots // num_ranks
    rank_node = np.arange(num_ranks) // (num_ranks // num_nodes)
    rows, col = np.arange(num_layers), np.arange(num_layers)[:, None]
    per_replica = w / counts
    order = np.argsort(-per_replica, axis=1, kind="stable")  # [M, E]
    items = np.repeat(order.ravel(), counts[col, order].ravel()).reshape(num_layers, num_slots)
    sizes = per_replica[col, items]  # [M, P]
    p2l = np.empty((num_layers, num_slots), dtype=np.int64)
    fill = np.zeros((num_layers, num_ranks), dtype=np.int64)
    load = np.zeros((num_layers, num_ranks))  # +inf once the rank is full
    on = np.zeros((num_layers, num_ranks, num_experts), dtype=bool)
    home = np.full((num_layers, num_experts), -1)  # node of each expert's first replica
    for j in range(num_slots):
        x = items[:, j]
        cand = load
        if avoid_colocation:
            ok = ~on[rows, :, x] & (load < np.inf)
            cand = np.where(ok.any(1, keepdims=True), np.where(ok, load, np.inf), load)
        r = cand.argmin(1)
        if num_nodes > 1:
            near = np.where(rank_node == home[rows, x][:, None], cand, np.inf)
            r_near = near.argmin(1)
            r = np.where(near[rows, r_near] <= cand[rows, r] + sizes[:, j], r_near, r)
            home[rows, x] = np.where(home[rows, x] < 0, rank_node[r], home[rows, x])
        p2l[rows, r * per_rank + fill[rows, r]] = x
        fill[rows, r] += 1
        load[rows, r] = np.where(fill[rows, r] < per_rank, load[rows, r] + sizes[:, j], np.inf)
        on[rows, r, x] = True
    return p2l


def _repair(w: np.ndarray, p2l: np.ndarray, num_ranks: int) -> np.ndarray:
    """p2l [M, P] without co-location (a copy): each extra replica on a rank swaps with a slot of a
    rank lacking its expert (the swap that keeps the two ranks most even), or failing that becomes
    a replica of the hottest expert the rank lacks. Loops only over offending slots."""
    p2l = p2l.copy()
    per_rank = p2l.shape[1] // num_ranks
    slot_rank = np.arange(p2l.shape[1]) // per_rank
    later = np.tri(per_rank, k=-1, dtype=bool)  # [C, C]: j < i
    while True:
        grouped = p2l.reshape(len(p2l), num_ranks, per_rank)
        dup = (grouped[:, :, :, None] == grouped[:, :, None, :]).any(3, where=later)
        layers, slots = np.nonzero(dup.reshape(len(p2l), -1))
        if not layers.size:
            return p2l
        for layer in np.unique(layers):  # one fix per layer per pass; the rest are re-detected
            row, s = p2l[layer], int(slots[layers == layer][0])
            x, r = row[s], slot_rank[s]
            counts = np.bincount(row, minlength=w.shape[1])
            size = w[layer, row] / counts[row]  # [P]
            load = np.bincount(slot_rank, weights=size, minlength=num_ranks)
            has_x = np.zeros(num_ranks, dtype=bool)
            has_x[slot_rank[row == x]] = True
            cand = ~has_x[slot_rank] & ~np.isin(row, row[slot_rank == r])
            if cand.any():
                d = size[s] - size
                b = int(
                    np.argmin(np.where(cand, np.maximum(load[r] - d, load[slot_rank] + d), np.inf))
                )
                row[s], row[b] = row[b], row[s]
                continue
            lacking = np.setdiff1d(np.arange(w.shape[1]), row[slot_rank == r])
            lacking = lacking[counts[lacking] < num_ranks]  # non-empty whenever C <= E
            row[s] = lacking[np.argmax(w[layer, lacking] / (counts[lacking] + 1))]


# --------------------------------------------------------------------------------- local search


@dataclass
class _Search:
    """Mutable local-search state over M MoE layers (internal; arrays change in place).

    counts [M, E] replicas per expert (1..R); on [M, R, E] rank r holds expert e; node_count
    [M, E, N] replicas of e on node n; slot_load [M, P] = w / counts of the slot's expert;
    rank_load [M, R]; spread_cost [M] load-equivalent price of one more node spanned by an
    expert (0 when N = 1), a tie-breaker between moves of nearly equal gain.
    """

    w: np.ndarray  # [M, E]
    p2l: np.ndarray  # [M, P], no co-location
    num_ranks: int
    num_nodes: int = 1

    def __post_init__(self) -> None:
        num_layers, num_experts = self.w.shape
        rows = np.arange(num_layers)[:, None]
        self.per_rank = self.p2l.shape[1] // self.num_ranks
        self.slot_rank = np.arange(self.p2l.shape[1]) // self.per_rank  # [P]
        self.rank_node = np.arange(self.num_ranks) // (self.num_ranks // self.num_nodes)
        self.counts = np.zeros((num_layers, num_experts), dtype=np.int64)
        np.add.at(self.counts, (rows, self.p2l), 1)
        self.on = np.zeros((num_layers, self.num_ranks, num_experts), dtype=bool)
        self.on[rows, self.slot_rank, self.p2l] = True
        self.node_count = np.zeros((num_layers, num_experts, self.num_nodes), dtype=np.int64)
        np.add.at(self.node_count, (rows, self.p2l, self.rank_node[self.slot_rank]), 1)
        weight = _SPREAD_WEIGHT if self.num_nodes > 1 else 0.0
        self.spread_cost = weight * self.w.sum(1) / self.num_ranks
        self.slot_load = np.empty(self.p2l.shape)
        self.rank_load = np.empty((num_layers, self.num_ranks))
        self.refresh(np.arange(num_layers))

    def refresh(self, rows: np.ndarray) -> None:
        """Recomputes slot and rank loads of `rows` from p2l and counts."""
        col, p2l = rows[:, None], self.p2l[rows]
        slot_load = self.w[col, p2l] / self.counts[col, p2l]
        self.slot_load[rows] = slot_load
        self.rank_load[rows] = slot_load.reshape(len(rows), self.num_ranks, self.per_rank).sum(2)

    def swap(self, rows: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
        """Exchanges the experts of slots a and b (different ranks and experts) in each row;
        the (row, rank) pairs touched must be distinct across the batch."""
        xa, xb = self.p2l[rows, a], self.p2l[rows, b]
        ra, rb = self.slot_rank[a], self.slot_rank[b]
        self.p2l[rows, a], self.p2l[rows, b] = xb, xa
        self.on[rows, ra, xa] = self.on[rows, rb, xb] = False
        self.on[rows, ra, xb] = self.on[rows, rb, xa] = True
        if self.num_nodes > 1:
            na, nb = self.rank_node[ra], self.rank_node[rb]
            for x, src, dst in ((xa, na, nb), (xb, nb, na)):
                np.add.at(self.node_count, (rows, x, src), -1)
                np.add.at(self.node_count, (rows, x, dst), 1)

    def replace(self, rows: np.ndarray, b: np.ndarray, y: np.ndarray) -> None:
        """Slot b's expert x (>= 2 replicas) becomes expert y (absent from b's rank)."""
        x, rb = self.p2l[rows, b], self.slot_rank[b]
        self.p2l[rows, b] = y
        self.on[rows, rb, x], self.on[rows, rb, y] = False, True
        self.counts[rows, x] -= 1
        self.counts[rows, y] += 1
        self.node_count[rows, x, self.rank_node[rb]] -= 1
        self.node_count[rows, y, self.rank_node[rb]] += 1


def _best_swaps(st: _Search, act: np.ndarray, hot: np.ndarray, cool: np.ndarray) -> Moves:
    """For each active layer and hot rank hot[:, t] ([n, T]): the swap of one of its slots with a
    slot of a partner rank cool [n, K] minimising max(new hot load, new partner load), plus
    `spread_cost` per node newly spanned. Returns (gain [n, T] = hot load - that max, or -inf
    where nothing improves; hot-rank slot [n, T]; partner slot [n, T]). Arrays [n, T, C, K*C]."""
    n, num_hot = hot.shape
    per_rank, col = st.per_rank, np.arange(n)[:, None]
    slot_load, rank_load, p2l = st.slot_load[act], st.rank_load[act], st.p2l[act]
    hot_slots = (hot[:, :, None] * per_rank + np.arange(per_rank)).reshape(n, -1)  # [n, TC]
    cool_slots = (cool[:, :, None] * per_rank + np.arange(per_rank)).reshape(n, -1)  # [n, KC]
    d = (
        slot_load[col, hot_slots].reshape(n, num_hot, per_rank, 1)
        - slot_load[col, cool_slots][:, None, None, :]
    )
    peak = rank_load[col, hot][:, :, None, None]
    partner = np.repeat(rank_load[col, cool], per_rank, axis=1)[:, None, None, :]
    new_peak = np.maximum(peak - d, partner + d)  # [n, T, C, KC]
    xa, xb = p2l[col, hot_slots], p2l[col, cool_slots]
    # Forbidden: the partner rank already holds xa, or the hot rank already holds xb; no gain.
    bad = np.repeat(st.on[act[:, None, None], cool[:, None, :], xa[:, :, None]], per_rank, axis=2)
    bad = bad.reshape(new_peak.shape)
    bad |= st.on[act[:, None, None], hot[:, :, None], xb[:, None, :]][:, :, None, :]
    bad |= new_peak >= peak * (1 - 1e-12)
    score = new_peak
    if st.num_nodes > 1:
        score = new_peak + (
            st.spread_cost[act, None, None, None] * _swap_spread(st, act, hot, xa, cool, xb)
        )
    flat = np.where(bad, np.inf, score).reshape(n, num_hot, -1)
    k, t = flat.argmin(2), np.arange(num_hot)[None, :]  # [n, T]
    gain = np.where(
        flat[col, t, k] < np.inf,
        peak[:, :, 0, 0] - new_peak.reshape(flat.shape)[col, t, k],
        -np.inf,
    )
    kc = cool_slots.shape[1]
    return gain, hot_slots[col, t * per_rank + k // kc], cool_slots[col, k % kc]


def _swap_spread(
    st: _Search, act: np.ndarray, hot: np.ndarray, xa: np.ndarray, cool: np.ndarray, xb: np.ndarray
) -> np.ndarray:
    """Change [n, T, C, K*C] in the nodes spanned by xa [n, T*C] plus xb [n, K*C] if swapped."""
    n, num_hot = hot.shape
    per_rank, col = st.per_rank, np.arange(n)[:, None]
    node_h, node_c = st.rank_node[hot], st.rank_node[cool]  # [n, T], [n, K]
    node_ha, node_cb = np.repeat(node_h, per_rank, 1), np.repeat(node_c, per_rank, 1)
    count = st.node_count[act]  # [n, E, N]
    a_in = count[col[:, :, None], xa[:, :, None], node_c[:, None, :]] == 0  # [n, TC, K]
    a_out = count[col, xa, node_ha] == 1  # [n, TC]
    delta_a = np.repeat(a_in, per_rank, 2).astype(np.int64) - a_out[..., None]
    b_in = count[col[:, :, None], xb[:, None, :], node_h[:, :, None]] == 0  # [n, T, KC]
    delta_b = b_in.astype(np.int64) - (count[col, xb, node_cb] == 1)[:, None, :]
    delta = delta_a.reshape(n, num_hot, per_rank, -1) + delta_b[:, :, None, :]
    return np.where((node_h[:, :, None] == node_cb[:, None, :])[:, :, None, :], 0, delta)


def _best_replaces(st: _Search, act: np.ndarray, hot: np.ndarray) -> Moves:
    """Per active layer: one more replica for the expert y on the hottest rank hot [n] whose extra
    replica relieves it most, written over a slot b whose expert x keeps >= 1 replica; b minimises
    the new peak over changed ranks (x's other holders bounded by the hottest of them plus x's
    rise). Returns (gain [n] or -inf, slot b [n], expert y [n]). Arrays [n, P]."""
    num_ranks, per_rank = st.num_ranks, st.per_rank
    ar, col = np.arange(len(act)), act[:, None]
    w, counts, p2l, rank_load = st.w[act], st.counts[act], st.p2l[act], st.rank_load[act]
    peak = rank_load[ar, hot]
    xa = p2l[ar[:, None], hot[:, None] * per_rank + np.arange(per_rank)]  # [n, C]
    ca, wa = counts[ar[:, None], xa], w[ar[:, None], xa]
    relief = np.where(ca < num_ranks, wa / (ca * (ca + 1)), -1.0)  # drop on each holder of xa
    j = relief.argmax(1)
    y, gy = xa[ar, j], relief[ar, j]
    cx, size = counts[ar[:, None], p2l], st.slot_load[act]  # [n, P]
    y_on = np.repeat(st.on[col, np.arange(num_ranks), y[:, None]], per_rank, axis=1)
    ok = (cx >= 2) & ~y_on & (gy > 0)[:, None]
    gx = size / np.maximum(cx - 1, 1)  # rise on each holder of x
    slot_rank_load = rank_load[:, st.slot_rank]
    new_b = slot_rank_load - size + (w[ar, y] / (counts[ar, y] + 1))[:, None]
    new_hot = peak[:, None] - gy[:, None] + gx * st.on[col, hot[:, None], p2l]
    r_idx, s_idx = np.nonzero((cx >= 2) & (st.slot_rank != hot[:, None]))
    top = np.full(w.shape, -np.inf)  # [n, E]: hottest rank but `hot` holding each expert
    np.maximum.at(top, (r_idx, p2l[r_idx, s_idx]), slot_rank_load[r_idx, s_idx])
    new_peak = np.maximum(np.maximum(new_hot, new_b), top[ar[:, None], p2l] + gx)
    ok &= new_peak < peak[:, None] * (1 - 1e-12)
    score = new_peak
    if st.num_nodes > 1:
        node_b = st.rank_node[st.slot_rank]
        spread = (st.node_count[act, y][:, node_b] == 0).astype(np.int64) - (
            st.node_count[col, p2l, node_b] == 1
        )
        score = new_peak + st.spread_cost[col] * spread
    b = np.where(ok, score, np.inf).argmin(1)
    return np.where(ok[ar, b], peak - new_peak[ar, b], -np.inf), b, y


def _best_drops(st: _Search, act: np.ndarray, hot: np.ndarray) -> Moves:
    """Per active layer: a slot on the hottest rank hot [n] whose expert x has >= 2 replicas
    becomes a replica of the expert y the rank lacks that is lightest per replica after it: the
    rank sheds x's share, x's other holders each take x's rise (bounded by the hottest of them).
    Returns (gain [n] or -inf, slot [n], expert y [n]). Arrays [n, C] and [n, E]."""
    ar, col = np.arange(len(act)), np.arange(len(act))[:, None]
    w, counts, rank_load = st.w[act], st.counts[act], st.rank_load[act]
    peak = rank_load[ar, hot]
    slots = hot[:, None] * st.per_rank + np.arange(st.per_rank)  # [n, C]
    x = st.p2l[act[:, None], slots]
    cx, size = counts[col, x], st.slot_load[act[:, None], slots]
    added = np.where(~st.on[act, hot] & (counts < st.num_ranks), w / (counts + 1), np.inf)
    y = added.argmin(1)
    holders = st.on[act[:, None], :, x]  # [n, C, R]
    holders[ar, :, hot] = False
    top = np.where(holders, rank_load[:, None, :], -np.inf).max(2)  # [n, C]
    new_peak = np.maximum(
        peak[:, None] - size + added[ar, y][:, None], top + size / np.maximum(cx - 1, 1)
    )
    new_peak[(cx < 2) | (new_peak >= peak[:, None] * (1 - 1e-12))] = np.inf
    j = new_peak.argmin(1)
    return np.where(new_peak[ar, j] < np.inf, peak - new_peak[ar, j], -np.inf), slots[ar, j], y


def _moves(
    st: _Search,
    act: np.ndarray,
    num_hot: int,
    num_cool: int,
    left: np.ndarray,
    floor: np.ndarray,
    frugal: bool,
) -> tuple[np.ndarray, ...]:
    """One step's candidates for the active layers: swaps [n, T] of the T hottest ranks with the K
    coolest (the hottest retries against every rank where that gains too little); the best
    replacement [n] for the hottest rank (if `frugal` always, else where no swap gains enough),
    and where neither does, its best drop. Moves the budget `left` [n] cannot pay gain -inf."""
    order = np.argsort(st.rank_load[act], axis=1)
    hot = order[:, ::-1][:, :num_hot]
    gain_swap, a, b = _best_swaps(st, act, hot, order[:, :num_cool])
    retry = np.flatnonzero(gain_swap[:, 0] <= 2 * floor)
    if retry.size and num_cool < st.num_ranks:
        g, a_r, b_r = _best_swaps(st, act[retry], hot[retry, :1], order[retry])
        gain_swap[retry, 0], a[retry, 0], b[retry, 0] = g[:, 0], a_r[:, 0], b_r[:, 0]
    gain_swap[left < 2] = -np.inf
    gain_rep = np.full(len(act), -np.inf)
    slot, y = np.zeros(len(act), dtype=np.int64), np.zeros(len(act), dtype=np.int64)
    need = np.flatnonzero((left >= 1) & (frugal | (gain_swap[:, 0] <= 2 * floor)))
    if need.size:
        gain_rep[need], slot[need], y[need] = _best_replaces(st, act[need], hot[need, 0])
    stuck = np.flatnonzero((gain_swap[:, 0] <= 2 * floor) & (gain_rep <= floor) & (left >= 1))
    if stuck.size:
        gain_rep[stuck], slot[stuck], y[stuck] = _best_drops(st, act[stuck], hot[stuck, 0])
    return hot, gain_swap, a, b, gain_rep, slot, y


def _refine(
    st: _Search,
    previous: np.ndarray | None = None,
    budget: int = 0,
    min_gain: float = 0.0,
    num_hot: int = 2,
    num_cool: int = 4,
) -> np.ndarray:
    """Greedy local search; returns the best p2l [M, P] seen. Each step, in every active layer,
    the hottest rank takes the better of its best swap (2 slot rewrites) and its best replacement
    or drop (1 rewrite); after a swap the next hottest ranks (num_hot in all) take their best
    swaps, each rank in one move per step. A move lowers its hot rank and lifts no changed rank to
    that level, so the peak never rises; a layer stops when no move gains _REL_EPS x mean load
    per rewritten slot. With `previous` [M, P] ("frugal"): moves are ranked by gain per rewritten
    slot, secondary swaps only touch ranks above the level the first move reaches, a move must
    gain >= min_gain x peak per rewritten slot, a layer stops before its slots differing from
    `previous` exceed `budget`, and moves after its last strict improvement are dropped."""
    frugal = previous is not None
    num_hot, num_cool = min(num_hot, max(st.num_ranks // 2, 1)), min(num_cool, st.num_ranks)
    active = np.ones(len(st.w), dtype=bool)
    best, best_peak = st.p2l.copy(), st.rank_load.max(1)
    used = (st.p2l != previous).sum(1) if previous is not None else np.zeros(len(st.w), np.int64)
    tol = _REL_EPS * st.w.sum(1) / st.num_ranks  # [M]
    for _ in range(4 * st.p2l.shape[1] + 8):
        act = np.flatnonzero(active)
        if not act.size:
            break
        left = budget - used[act] if frugal else np.full(len(act), np.inf)
        floor = np.maximum(tol[act], (min_gain if frugal else 0.0) * st.rank_load[act].max(1))
        hot, gain_swap, a, b, gain_rep, slot, y = _moves(
            st, act, num_hot, num_cool, left, floor, frugal
        )
        swap_ok, rep_ok = gain_swap[:, 0] > 2 * floor, gain_rep > floor
        score_swap = gain_swap[:, 0] / 2 if frugal else gain_swap[:, 0]
        do_rep = rep_ok & (~swap_ok | (gain_rep > score_swap))
        take = _take_swaps(st, act, hot, gain_swap, b, swap_ok & ~do_rep, left, 2 * floor, frugal)
        active[act[~do_rep & ~take[:, 0]]] = False
        st.replace(act[do_rep], slot[do_rep], y[do_rep])
        rows, ts = np.nonzero(take)
        st.swap(act[rows], a[rows, ts], b[rows, ts])
        changed = act[do_rep | take[:, 0]]
        st.refresh(changed)
        if previous is not None:
            used[changed] = (st.p2l[changed] != previous[changed]).sum(1)
        better = changed[st.rank_load[changed].max(1) < best_peak[changed] - tol[changed]]
        best[better], best_peak[better] = st.p2l[better], st.rank_load[better].max(1)
    return best


def _take_swaps(
    st: _Search,
    act: np.ndarray,
    hot: np.ndarray,
    gain: np.ndarray,
    b: np.ndarray,
    first: np.ndarray,
    left: np.ndarray,
    floor: np.ndarray,
    frugal: bool,
) -> np.ndarray:
    """Which swaps [n, T] to apply: column 0 where `first`; column t > 0 if it gains more than
    `floor`, its two ranks are untouched so far, the budget pays 2 more rewrites, and (`frugal`)
    its hot rank is above the level the first swap brings the hottest rank to."""
    n, num_hot = hot.shape
    ar = np.arange(n)
    take = np.zeros((n, num_hot), dtype=bool)
    take[:, 0] = first
    busy = np.zeros((n, st.num_ranks), dtype=bool)
    busy[ar, hot[:, 0]] = busy[ar, st.slot_rank[b[:, 0]]] = first
    level = st.rank_load[act, hot[:, 0]] - gain[:, 0]
    for t in range(1, num_hot):
        partner = st.slot_rank[b[:, t]]
        ok = first & (gain[:, t] > floor) & ~busy[ar, hot[:, t]] & ~busy[ar, partner]
        ok &= left >= 2 * (take.sum(1) + 1)
        if frugal:
            ok &= st.rank_load[act, hot[:, t]] > level
        take[:, t] = ok
        busy[ar, hot[:, t]] |= ok
        busy[ar, partner] |= ok
    return take


# -------------------------------------------------------------------------------------- planning
