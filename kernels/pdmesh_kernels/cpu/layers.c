/* DeepSeek-V3 decoder layers for a few tokens on CPU, in one call: no Python between ops.
 *
 * Each layer: rms_norm -> MLA attention over the paged latent cache (the tokens' own latents
 * written first; the absorbed form, prefill chunks expanded) -> residual -> rms_norm -> dense
 * SwiGLU MLP, or sigmoid group-limited routing over the routed experts plus the shared experts ->
 * residual.
 * The arithmetic is the engine's torch path (fp32 throughout, the same formulas); only the order
 * of the sums differs, so results agree to fp32 rounding.
 *
 * Built with -DPD_BF16 the projection and expert weights and the KV cache are bf16 (read and
 * widened to fp32 in registers, cache entries rounded to nearest even when written), everything
 * else stays fp32: activations, sums, norms, biases, the router. Half the bytes per step, the
 * same formulas. On a CPU with AVX512-BF16 the products take native bf16 dot products instead,
 * their inputs rounded to bf16 (PD_DP, at `round_rows`), and so do the absorbed attention's scores
 * and sums (the queries and probabilities rounded to bf16).
 *
 * Layouts (prepared once at load time by the engine):
 *   linear weights   W [in, out] (nn.Linear's weight transposed: y[c] += x[i] * W[i, c]) in
 *                    panels (`pd_pack`: of 16 columns, of row pairs in a PD_DP build); the fp32
 *                    build's routers too (the bf16 build's fp32 routers are read row-major)
 *   w_uk [H, N, L], w_uv [H, L, V]   (kv_b_proj split per head, as the torch path's bmm uses),
 *                                     each head's slice in panels (`pd_pack`), one after another
 *   kv_b [L, H (N + V)]               (kv_b_proj whole, a linear weight: the prefill's expansion)
 *   w13 [P, D, 2I], w2 [P, I, D]      (the experts' row tables: gate|up, then down), each slot
 *                                     in panels (`pd_pack`)
 *   kv cache [num_blocks, block_size, L + R]; rope tables [max_pos, R] as (cos, cos), (-sin, sin)
 *
 * Legend: T tokens, D hidden, H heads, N nope dim, R rope dim, L kv_lora_rank, V v dim,
 * E logical experts, K experts per token, P slots, I expert width.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int64_t hidden, num_heads, q_lora_rank, kv_lora_rank, rope_dim, nope_dim, v_dim;
    int64_t n_experts, top_k, n_group, topk_group, norm_topk_prob;
    int64_t block_size, rope_interleave, num_threads;
    float rms_eps, latent_eps, attn_scale, routed_scaling;
} pd_dims;

/* wt: a weight element, kt: a KV cache element (bf16 bits in a PD_BF16 build) */
#ifdef PD_BF16
typedef uint16_t wt;
#else
typedef float wt;
#endif
typedef wt kt;
#if defined(PD_BF16) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define PD_DP 1 /* native bf16 dot products (see round_rows) */
#endif

typedef struct {
    const float *input_norm, *post_norm;
    const wt *q_a;
    const float *q_a_norm;
    const wt *q_b, *q_proj; /* q_proj when q_lora_rank == 0 */
    const wt *kv_a;
    const float *kv_a_norm;
    const wt *w_uk, *w_uv, *kv_b, *o_proj; /* kv_b NULL: every token in the absorbed form */
    const float *q_a_bias, *kv_a_bias, *o_bias; /* attention biases (NULL: none) */
    int64_t mlp_width; /* dense MLP width, or the shared experts' (0: none) */
    const wt *gate, *up, *down;
    int64_t moe_index; /* row in the expert-load output; -1: a dense layer */
    int64_t moe_width, num_slots;
    const float *router, *router_bias; /* [D, E], [E] */
    const wt *w13, *w2;
    const int64_t *replicas, *replica_counts; /* NULL: slot == logical expert */
    int64_t replicas_width;
} pd_layer;

enum { PAR_MIN_MACS = 1 << 14, PAR_MIN_ROW_WORK = 1 << 17 };

/* Threads for a loop over T independent rows of `row_work` elements each (norms, routing, sums):
 * all nt for a prefill's thousands of rows, 1 for a decode batch's few, not worth waking them. */
static inline int row_threads(int64_t T, int64_t row_work, int nt) {
    return T > 1 && T * row_work >= PAR_MIN_ROW_WORK ? nt : 1;
}

#define MIN(a, b) ((a) < (b) ? (a) : (b))
#ifdef __AVX__
#include <immintrin.h>
#endif

/* ---------------------------------------------------------------- matmul: Y = X @ W -------- */
/* 8 floats in a vector register (GCC/Clang vector extension: AVX on x86, NEON pairs on ARM);
 * aligned(4) makes loads and stores through it unaligned-safe. */
typedef float v8 __attribute__((vector_size(32), aligned(4)));

/* load8(p): 8 elements at p as fp32 lanes; load1(p): one. bf16 is the top half of an fp32. */
#ifdef PD_BF16
#ifdef __AVX2__ /* one widening load (vpmovzxwd), where the generic form below takes five ops */
static inline v8 load8(const uint16_t *p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return (v8)_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
#else
typedef uint16_t u16x8 __attribute__((vector_size(16), aligned(2)));
typedef uint32_t u32x8 __attribute__((vector_size(32), aligned(4)));
static inline v8 load8(const uint16_t *p) {
    return (v8)(__builtin_convertvector(*(const u16x8 *)p, u32x8) << 16);
}
#endif
static inline float load1(const uint16_t *p) {
    const uint32_t bits = (uint32_t)*p << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
static inline uint16_t to_bf16(float f) { /* round to nearest even (no NaNs here) */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}
#else
static inline v8 load8(const float *p) { return *(const v8 *)p; }
static inline float load1(const float *p) { return *p; }
#endif

/* Register tiles (wtile_NT): Y[t, :16] = X[t, :k] @ P for NT tokens, P [k, 16] a packed panel of
 * W (the products of a build without bf16 dot products; a bf16 build's widened to fp32 as
 * loaded): each row of P is loaded once for all NT tokens, the NT x 16 sums stay in registers over
 * all k rows and Y is written once. Every `every` rows the tile fetches one line, `fetch` (NULL:
 * none) then `fetch_step` bytes on: memory work spread over the sums. */
#define TILE(NAME, PT, LOAD, NT)                                                                 \
    static inline void NAME##_##NT(const float *X, int64_t ldx, const PT *P, float *Y,           \
                                   int64_t ldy, int64_t k, const char *fetch,                    \
                                   int64_t fetch_step, int64_t every) {                          \
        v8 acc[NT][2] = {{{0}}};                                                                 \
        for (int64_t i0 = 0; i0 < k; i0 += every, fetch = fetch ? fetch + fetch_step : NULL) {  \
            if (fetch) __builtin_prefetch(fetch);                                                \
            for (int64_t i = i0; i < MIN(k, i0 + every); i++) {                                  \
                const v8 lo = LOAD(P + 16 * i), hi = LOAD(P + 16 * i + 8);                       \
                _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                           \
                    const float xv = X[t * ldx + i];                                             \
                    acc[t][0] += xv * lo, acc[t][1] += xv * hi;                                  \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
        _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++)                                     \
            *(v8 *)(Y + t * ldy) = acc[t][0], *(v8 *)(Y + t * ldy + 8) = acc[t][1];              \
    }
#define TILES(NAME, PT, LOAD)                                                                    \
    TILE(NAME, PT, LOAD, 6)                                                                      \
    TILE(NAME, PT, LOAD, 5)                                                                      \
    TILE(NAME, PT, LOAD, 4)                                                                      \
    TILE(NAME, PT, LOAD, 3)                                                                      \
    TILE(NAME, PT, LOAD, 2)                                                                      \
    TILE(NAME, PT, LOAD, 1)                                                                      \
    typedef void NAME##_fn(const float *, int64_t, const PT *, float *, int64_t, int64_t,        \
                           const char *, int64_t, int64_t);                                      \
    static NAME##_fn *const NAME##_for[7] = {0,        NAME##_1, NAME##_2, NAME##_3,             \
                                             NAME##_4, NAME##_5, NAME##_6};
#ifndef PD_DP
TILES(wtile, wt, load8)
#endif

/* Start loading x[:n] into the cache. */
static inline void fetch(const kt *x, int64_t n) {
    for (int64_t off = 0; off < n * (int64_t)sizeof(kt); off += 64) __builtin_prefetch((const char *)x + off);
}

enum { TOKEN_BLOCK = 96 }; /* tokens whose inputs stay in L2 while W's column panels pass */

enum { PANEL = 16 }; /* columns a panel */
#ifndef PD_DP /* (a build with bf16 dot products has panels of row pairs: see pair_tile) */
/* ---- panels: weights packed once at load (pd_pack) ---------------------------------------- *
 * W [k, n] as ceil(n / 16) panels one after another, each its k rows of 16 columns ([n16 / 16][k]
 * [16] of wt, the last zero-padded). A thread's share of columns is then one sequential stream,
 * no call packs, and few tokens sweep it as many do (each column one chain of sums in row order,
 * whatever T), the tiles fetching the next panel. Every linear weight, expert slot and head's
 * absorbed slice is stored so (in a build with bf16 dot products, as panels of row pairs: see
 * pair_tile).
 * Measured on `small` (fp32, 2 threads, forward ms, 3 alternating runs, against streaming W's
 * rows for up to 8 tokens and packing panels on every call above): one decode at context 320 6.7-7.2 -> 4.9-5.3; 32
 * decodes 39.6-42.5 -> 37.2-39.2 (the attention and MLP products 15-25% faster); a prefill of 8
 * x 256 tokens 813-841 -> 812-817. The lm head alone (cold, 2 threads): 32 rows 3.1-3.3 -> 2.1.
 * The routed experts' slots too, against those two (the same runs after the above): 32 decodes 36.2-38.5 -> 31.8-33.7, one decode 4.4-4.7 -> 3.8-4.0, the prefill 726-784
 * -> 659-739; alone (cold, 704 experts, 2 threads), 2-4 tokens read them at 26-29 GB/s where
 * streaming their rows read 18-22. The bf16 build's experts (3 alternating runs): 32 decodes
 * 27.2-27.9 -> 23.3-25.3, one decode 3.9-4.3 -> 4.0-4.5 (within the noise of these runs). */
static inline int64_t panels_elems(int64_t k, int64_t n) {
    return (n + PANEL - 1) / PANEL * PANEL * k;
}

static void pack_panels(const wt *W, int64_t k, int64_t n, wt *P) {
    for (int64_t c = 0; c < n; c += PANEL)
        for (int64_t i = 0; i < k; i++) {
            wt *to = P + (c / PANEL * k + i) * PANEL;
            const int64_t w = MIN(PANEL, n - c);
            memcpy(to, W + i * n + c, sizeof(wt) * w);
            memset(to + w, 0, sizeof(wt) * (PANEL - w));
        }
}

/* One token's columns [c, c + 16 NP) from NP panels side by side: NP chains of sums per lane
 * where one panel alone would wait on each sum's latency. */
static inline __attribute__((always_inline)) void panel_row(const float *x, const wt *P, int64_t k,
                                                            float *y, const int NP) {
    v8 acc[4][2] = {{{0}}};
    for (int64_t i = 0; i < k; i++) {
        const float xv = x[i];
        _Pragma("GCC unroll 4") for (int g = 0; g < NP; g++) {
            const wt *p = P + (g * k + i) * PANEL;
            acc[g][0] += xv * load8(p), acc[g][1] += xv * load8(p + 8);
        }
    }
    _Pragma("GCC unroll 4") for (int g = 0; g < NP; g++)
        *(v8 *)(y + PANEL * g) = acc[g][0], *(v8 *)(y + PANEL * g + 8) = acc[g][1];
}

/* Y[t, c0:c1] = X[t, :k] @ W[:k, c0:c1] for t < T (single-threaded), W packed by pack_panels
 * (P), c0 a multiple of 16: each panel swept by the register tiles over a block of tokens, one
 * token by panel_row, 4 panels at a time. */
static void panel_cols(const float *X, int64_t ldx, const wt *P, int64_t k, float *Y,
                       int64_t ldy, int64_t T, int64_t c0, int64_t c1) {
    float edge[TOKEN_BLOCK * PANEL]; /* the last panel's sums where it is cut */
    int64_t c = c0;
    if (T == 1)
        for (; c + 4 * PANEL <= c1; c += 4 * PANEL) panel_row(X, P + c * k, k, Y + c, 4);
    for (int64_t t0 = 0; t0 < T; t0 += TOKEN_BLOCK) {
        const int64_t t1 = MIN(T, t0 + TOKEN_BLOCK);
        const int64_t tiles = (t1 - t0 + 5) / 6; /* tile j fetches rows j, j + tiles, ... */
        for (int64_t cc = c; cc < c1; cc += PANEL) {
            const int whole = cc + PANEL <= c1, fetch_next = t0 == 0 && cc + PANEL < c1;
            float *y = whole ? Y + t0 * ldy + cc : edge;
            const int64_t ld = whole ? ldy : PANEL;
            for (int64_t t = t0, j = 0; t < t1; t += 6, j++)
                wtile_for[MIN(6, t1 - t)](
                    X + t * ldx, ldx, P + cc * k, y + (t - t0) * ld, ld, k,
                    fetch_next ? (const char *)(P + (cc + PANEL) * k + j * PANEL) : NULL,
                    tiles * PANEL * (int64_t)sizeof(wt), fetch_next ? tiles : k);
            for (int64_t t = t0; !whole && t < t1; t++)
                memcpy(Y + t * ldy + cc, edge + (t - t0) * PANEL, sizeof(float) * (c1 - cc));
        }
    }
}
#endif

#ifdef PD_DP
/* ---- native bf16 dot products (AVX512-BF16): Y = X @ W with X rounded to bf16 ------------ *
 * vdpbf16ps adds a pair of bf16 products into each fp32 lane: lane c gets W[i, c] x[i] +
 * W[i + 1, c] x[i + 1], the rows taken in pairs (a zero row after an odd k). Each output column is
 * that one chain of pairs in row order from zero whichever tile sums it, so a row's result does
 * not depend on the rows beside it. X is rounded to bf16 (nearest even) once per call, as a bf16
 * GEMM's input is; the sums stay fp32. Every product takes them from panels of row pairs packed at
 * load (`panel_cols`, below): the linear weights, the routed experts and the heads' absorbed
 * slices.
 * Measured on `small` (a 2-core Zen 4 VM, bf16, 2 threads, forward ms, 3 alternating runs): 32
 * decodes at context 320 28.7-31.8 -> 24.5-27.3, one decode 4.75-5.10 -> 4.57-4.60. The products
 * alone (cold W, us): 32 tokens, 512 x 256, 120 -> 73, 512 x 1536 796 -> 517; warm, 1-4 tokens,
 * 2.4-4.4x faster. Read in place, two rows a pair, the experts' weights (cold, 1-4 tokens) came
 * 10-30% slower than the widening stream read them row by row, and with them the whole step was
 * no faster (28.9-30.8 against 26.9-29.8 ms): they take dot products since their slots are packed
 * into panels of pairs at load. */
/* xb [T, kp] = X [T, k] rounded to bf16, each row padded with zeros to kp (k rounded up to even) */
static void round_rows(const float *X, int64_t ldx, int64_t T, int64_t k, int64_t kp,
                       uint16_t *xb) {
    for (int64_t t = 0; t < T; t++) {
        const float *x = X + t * ldx;
        uint16_t *o = xb + t * kp;
        int64_t i = 0;
        for (; i + 16 <= k; i += 16)
            _mm256_storeu_si256((__m256i *)(o + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
        if (i < k) {
            const __mmask16 m = (__mmask16)((1u << (k - i)) - 1);
            _mm256_mask_storeu_epi16(o + i, m, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, x + i)));
        }
        for (i = k; i < kp; i++) o[i] = 0;
    }
}

static inline __m512bh x_pair(const uint16_t *xb, int64_t i) {
    uint32_t v;
    memcpy(&v, xb + i, sizeof v);
    return (__m512bh)_mm512_set1_epi32((int)v);
}

static inline __mmask32 cols_mask(int64_t left) {
    return left >= 32 ? 0xffffffffu : left <= 0 ? 0 : (__mmask32)((1ull << left) - 1);
}

/* the sums of one 32-column chunk as two lanes sets (unpack order: lo holds columns 0-3, 8-11,
 * 16-19, 24-27, hi the others) into y[:n] (n <= 32), in column order */
static inline void store_chunk(float *y, __m512 lo, __m512 hi, int64_t n) {
    const __m512i first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i second = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
    const __m512 a = _mm512_permutex2var_ps(lo, first, hi), b = _mm512_permutex2var_ps(lo, second, hi);
    if (n >= 32) {
        _mm512_storeu_ps(y, a), _mm512_storeu_ps(y + 16, b);
        return;
    }
    _mm512_mask_storeu_ps(y, (__mmask16)(n >= 16 ? 0xffff : (1u << n) - 1), a);
    if (n > 16) _mm512_mask_storeu_ps(y + 16, (__mmask16)((1u << (n - 16)) - 1), b);
}

/* Panels of row pairs (this build's layout of the linear weights and the experts, pd_pack): W
 * [k, n] as groups of 4 panels of 16 columns, one group after another, each group its ceil(k / 2)
 * pairs of rows i, i + 1 interleaved column by column ([n64 / 64][kp / 2][64][2], zero-padded), so
 * one 64-byte load is a pair's 16 columns in lane order for vdpbf16ps, and a tile of 4 panels
 * reads its group as one sequential stream: the experts take the dot products too, in every batch.
 * Measured on `small` (bf16, 2 threads, forward ms, 3 alternating runs) against panels of rows
 * widened to fp32 (the fp32 build's kernels): a prefill of 8 x 256 tokens 551-677 -> 506-609; 32
 * decodes (18.5-23.8 against 19.6-21.3) and one (3.8-4.2 against 3.7-4.2) within the noise, the
 * experts being bound by reading their weights there. The hidden states' error against the fp32
 * torch path (a random model, 3 sequences) max 0.0034 -> 0.0053, mean 0.00053 -> 0.00062.
 * The linear weights too, against dot products over their rows (3 alternating runs):
 * one decode 3.41-3.72 -> 2.52-2.92 ms, 32 decodes at context 320 20.2-22.4 -> 19.1-20.1 (the
 * attention projections and the dense MLP 25-45% faster, the lm head ~1.3 ms), a prefill of 8 x
 * 256 tokens 536-583 -> 524-557. Groups of 4 panels, against panels one after another (each
 * tile's 4 panels then 4 streams, 16 KiB apart for the experts' w13): the experts of `small` alone
 * (704 of them, 2-3 tokens each, cold, 2 threads, 4 alternating runs) 9.66-9.80 -> 8.52-8.91
 * ms, 28-29 -> 31-32 GB/s, what a plain sequential read of the same bytes got in the same minutes
 * (30 GB/s). Software fetches ahead (of the next panels, or 256 B to 64 KiB on) did not help. */
enum { GROUP = 4 * PANEL }; /* columns a group of panels */

static inline int64_t panels_elems(int64_t k, int64_t n) {
    return (n + GROUP - 1) / GROUP * GROUP * ((k + 1) / 2 * 2);
}

/* the first element of column c's panel (c a multiple of 16) in pair panels of kp rows */
static inline int64_t panel_at(int64_t c, int64_t kp) {
    return c / GROUP * GROUP * kp + c % GROUP * 2;
}

static void pack_panels(const uint16_t *W, int64_t k, int64_t n, uint16_t *P) {
    const int64_t kp = (k + 1) / 2 * 2;
    for (int64_t c = 0; c < (n + GROUP - 1) / GROUP * GROUP; c++)
        for (int64_t i = 0; i < kp; i++)
            P[c / GROUP * GROUP * kp + i / 2 * 2 * GROUP + c % GROUP * 2 + i % 2] =
                i < k && c < n ? W[i * n + c] : 0;
}

/* Y[t, :16 NP] = xb[t] @ NP pair panels side by side in one group (P the first one's first
 * element) for NT tokens: NT x NP sums in registers over all row pairs. The lines [ahead, ahead
 * + 64 lines) are fetched along the way, `per` lines a row pair (ahead NULL: none). */
static inline __attribute__((always_inline)) void pair_tile(const uint16_t *xb, int64_t kp,
                                                            const uint16_t *P, float *Y,
                                                            int64_t ldy, const char *ahead,
                                                            int64_t lines, int64_t per,
                                                            const int NT, const int NP) {
    __m512 acc[8][4];
    _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++)
        _Pragma("GCC unroll 4") for (int g = 0; g < NP; g++) acc[t][g] = _mm512_setzero_ps();
    for (int64_t i = 0; i < kp; i += 2) {
        __m512bh w[4];
        if (ahead && lines > 0) {
            for (int64_t u = 0; u < per; u++) __builtin_prefetch(ahead + 64 * u);
            ahead += 64 * per, lines -= per;
        }
        _Pragma("GCC unroll 4") for (int g = 0; g < NP; g++)
            w[g] = (__m512bh)_mm512_loadu_si512(P + i * GROUP + g * 2 * PANEL);
        _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {
            const __m512bh x = x_pair(xb + t * kp, i);
            _Pragma("GCC unroll 4") for (int g = 0; g < NP; g++)
                acc[t][g] = _mm512_dpbf16_ps(acc[t][g], w[g], x);
        }
    }
    _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++)
        _Pragma("GCC unroll 4") for (int g = 0; g < NP; g++)
            _mm512_storeu_ps(Y + t * ldy + PANEL * g, acc[t][g]);
}

/* pair_tile for nt <= 8 tokens and np (1, 2 or 4) panels, np * nt at most 16 */
static void pair_tiles(const uint16_t *xb, int64_t kp, const uint16_t *P, float *Y, int64_t ldy,
                       const char *ahead, int64_t lines, int nt, int np) {
    const int64_t per = (lines + kp / 2 - 1) / (kp / 2);
#define PAIR_CASE(NT)                                                                            \
    case NT:                                                                                     \
        if (np == 4 && NT <= 4) pair_tile(xb, kp, P, Y, ldy, ahead, lines, per, NT, 4);          \
        else if (np >= 2) pair_tile(xb, kp, P, Y, ldy, ahead, lines, per, NT, 2);                \
        else pair_tile(xb, kp, P, Y, ldy, ahead, lines, per, NT, 1);                             \
        break;
    switch (nt) {
        PAIR_CASE(1) PAIR_CASE(2) PAIR_CASE(3) PAIR_CASE(4)
        PAIR_CASE(5) PAIR_CASE(6) PAIR_CASE(7) PAIR_CASE(8)
    }
#undef PAIR_CASE
}

/* Y[t, c0:c1] = X[t, :k] @ W[:k, c0:c1] for t < T (single-threaded), W in pair panels (P), c0 a
 * multiple of 16: X rounded to bf16 once, then block by block of TOKEN_BLOCK tokens (whose rounded
 * rows stay in L2) the panels are swept by tiles of up to 8 tokens x 2 panels (4 panels for up to
 * 4 tokens; never across a group), so each is read from memory once for the whole block; the last
 * panel's sums go through a buffer where it is cut. With more than 4 tokens the first block's
 * tiles over a group fetch the next group meanwhile (cold W, 32 tokens, 2 threads, us: 512 x 8192
 * 952-1066 -> 757-815, 512 x 1536 173-192 -> 136-156, 192 x 512 30-32 -> 27; 8 tokens, 512 x 352
 * 24-26 -> 17-21; `small` bf16, 32 decodes at context 320, 3 alternating runs 17.2-18.1 ->
 * 15.3-16.4 ms a forward). Fewer tokens are bound by the reading, which the fetches only slowed
 * (the experts alone, 2-3 tokens: 6.8-9.0 -> 8.2-10.0 ms). */
static void panel_cols(const float *X, int64_t ldx, const uint16_t *P, int64_t k, float *Y,
                       int64_t ldy, int64_t T, int64_t c0, int64_t c1) {
    enum { X_ON_STACK = 8192 };
    const int64_t kp = (k + 1) / 2 * 2;
    uint16_t on_stack[X_ON_STACK];
    uint16_t *xb = T * kp <= X_ON_STACK ? on_stack : malloc(sizeof(uint16_t) * T * kp);
    if (!xb) abort();
    round_rows(X, ldx, T, k, kp, xb);
    float edge[8 * PANEL];
    const int64_t whole = c0 + (c1 - c0) / PANEL * PANEL;
    for (int64_t t0 = 0; t0 < T; t0 += TOKEN_BLOCK) {
        const int64_t t1 = MIN(T, t0 + TOKEN_BLOCK);
        const int wide = t1 - t0 <= 4 ? 4 : 2;
        for (int64_t c = c0; c < c1;) {
            const int64_t left = MIN(whole - c, GROUP - c % GROUP) / PANEL;
            const int np = c >= whole ? 1 : left >= wide ? wide : left >= 2 ? 2 : 1;
            const uint16_t *p = P + panel_at(c, kp);
            /* with more than 4 tokens (a tile's sums then outlast its reads) the tiles over this
             * group fetch the next group of these columns, each its share */
            const int64_t next = (c / GROUP + 1) * GROUP, group_lines = GROUP * kp * 2 / 64;
            const int64_t passes = (t1 - t0 + 7) / 8 * (GROUP / PANEL / np);
            const int64_t share = (group_lines + passes - 1) / passes;
            const char *ahead = next < c1 ? (const char *)(P + panel_at(next, kp)) : NULL;
            for (int64_t t = t0; t < t1; t += 8) {
                const int nt = (int)MIN(8, t1 - t);
                const int64_t pass = (t - t0) / 8 * (GROUP / PANEL / np) + c % GROUP / PANEL / np;
                const char *at = ahead && t0 == 0 && t1 > 4 ? ahead + 64 * pass * share : NULL;
                if (c < whole) {
                    pair_tiles(xb + t * kp, kp, p, Y + t * ldy + c, ldy, at, share, nt, np);
                    continue;
                }
                pair_tiles(xb + t * kp, kp, p, edge, PANEL, NULL, 0, nt, 1); /* the cut panel */
                for (int j = 0; j < nt; j++)
                    memcpy(Y + (t + j) * ldy + c, edge + j * PANEL, sizeof(float) * (c1 - c));
            }
            c += np * PANEL;
        }
    }
    if (xb != on_stack) free(xb);
}
#endif

/* One product of a `matmuls` call: Y [T, n] = X @ W [k, n] (a dense weight). */
typedef struct {
    const wt *W;
    float *Y;
    int64_t n;
} mm_job;

/* Products that share their input X [T, k], in one parallel region: each job's columns are split
 * into one part per thread (multiples of 16), parts handed out round-robin, so the threads get
 * equal shares of every job. With a few tokens and at least a job per thread, the jobs go whole
 * instead: a thread streams whole rows of W, where parts read pieces of every row (one decode
 * of `small`, forward ms, fp32 | bf16: 7.64 -> 7.16 | 4.98 -> 4.66; 4 decodes, fp32: 18.5 ->
 * 17.0; the q_a/kv_a pair and the dense gate/up pair, of near or equal size). One thread, the
 * jobs whole, when the work is too small to pay for more. */
static void matmuls(const float *X, int64_t T, int64_t k, const mm_job *jobs, int njobs, int nt) {
    int64_t macs = 0;
    for (int j = 0; j < njobs; j++) macs += T * k * jobs[j].n;
    const int threads = nt > 1 && macs >= PAR_MIN_MACS ? nt : 1;
    const int parts = T <= 8 && njobs >= threads ? 1 : threads; /* per job */
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int64_t item = 0; item < (int64_t)njobs * parts; item++) {
        const mm_job *job = jobs + item / parts;
        const int64_t part = item % parts, chunk = ((job->n + parts - 1) / parts + 15) / 16 * 16;
        const int64_t c0 = MIN(job->n, part * chunk), c1 = MIN(job->n, c0 + chunk);
        if (c0 < c1) panel_cols(X, k, job->W, k, job->Y, job->n, T, c0, c1);
    }
}

/* Y [T, n] = X [T, k] @ W [k, n] (a dense weight) */
static void matmul(const float *X, const wt *W, float *Y, int64_t T, int64_t k, int64_t n,
                   int nt) {
    const mm_job job = {W, Y, n};
    matmuls(X, T, k, &job, 1, nt);
}

/* ---------------------------------------------------------------- small pieces ------------- */
static void add_bias(float *y, const float *bias, int64_t T, int64_t n) {
    if (!bias) return;
    for (int64_t t = 0; t < T; t++)
        for (int64_t c = 0; c < n; c++) y[t * n + c] += bias[c];
}

static void rms_norm(const float *x, const float *w, float *y, int64_t n, float eps) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    const float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) y[i] = x[i] * r * w[i];
}

typedef int32_t vi8 __attribute__((vector_size(32), aligned(4)));

/* exp(x) for x <= 0 (softmax numerators), 8 lanes at a time: Cephes' range reduction
 * x = n ln2 + r and degree-6 polynomial (about 1 ulp); below -87 it returns exp(-87) ~ 1.6e-38,
 * which no softmax sum notices. */
static inline v8 exp_nonpositive(v8 x) {
    const v8 floor_x = (v8){0} - 87.0f;
    const vi8 below = x < floor_x;
    x = (v8)((below & (vi8)floor_x) | (~below & (vi8)x));
    const v8 y = x * 1.44269504088896341f + 0.5f;
    vi8 n = __builtin_convertvector(y, vi8); /* truncation: one too high where y < 0 */
    n += __builtin_convertvector(n, v8) > y;  /* -1 there: floor(y) */
    const v8 nf = __builtin_convertvector(n, v8);
    const v8 r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
    v8 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * (v8)((n + 127) << 23);
}

/* x * sigmoid(x) (with_x) or sigmoid(x), 8 lanes at a time: e = exp(-|x|) by exp_nonpositive,
 * then x / (1 + e) where x >= 0 and x e / (1 + e) below, so no lane overflows. */
static inline v8 sigmoid_of(v8 x, int with_x) {
    const vi8 negative = x < 0, sign = (vi8){0} + INT32_MIN;
    const v8 e = exp_nonpositive((v8)((vi8)x | sign)); /* exp(-|x|) */
    const v8 top = (v8)((negative & (vi8)e) | (~negative & (vi8)((v8){0} + 1.0f)));
    return (with_x ? x * top : top) / (1.0f + e);
}

#ifdef __AVX512F__
/* exp_nonpositive in 16 lanes, the same steps to the same bits: the floor by rounding down, the
 * 2^n by scalef. */
static inline __m512 exp16_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 y = _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f));
    const __m512 nf = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fmadd_ps(nf, _mm512_set1_ps(2.12194440e-4f),
                                     _mm512_fnmadd_ps(nf, _mm512_set1_ps(0.693359375f), x));
    __m512 p = _mm512_fmadd_ps(r, _mm512_set1_ps(1.9875691500e-4f), _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, nf);
}

/* sigmoid_of in 16 lanes, the same steps to the same bits (sigmoid_rows over 1M values in
 * [-100, 100], alone: 675-677 -> 393-396 us, SiLU times u 791-966 -> 545-633) */
static inline __m512 sigmoid16_of(__m512 x, int with_x) {
    const __mmask16 negative = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 e = exp16_nonpositive(_mm512_castsi512_ps(_mm512_or_si512(
        _mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN)))); /* exp(-|x|) */
    const __m512 top = _mm512_mask_blend_ps(negative, _mm512_set1_ps(1.0f), e);
    return _mm512_div_ps(with_x ? _mm512_mul_ps(x, top) : top, _mm512_add_ps(e, _mm512_set1_ps(1.0f)));
}
#endif

/* y[:n] = sigmoid(x[:n]) (with_x: x sigmoid(x), SiLU), times u[:n] unless u is NULL; a short
 * tail goes through a padded vector, so every element is computed alike. Against the scalar form
 * (expf, then a division; at most 1.5e-7 from the exact value over [-100, 100], this 1.8e-7 for
 * sigmoid, 2.2e-7 for SiLU), `small` bf16, 32 decodes at context 320, 3 alternating runs, ms a
 * forward: the routing 0.28-0.31 -> 0.23-0.26, the dense layer's MLP 0.70-0.79 -> 0.55-0.64. */
static void sigmoid_rows(const float *x, const float *u, float *y, int64_t n, int with_x) {
    int64_t i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16) {
        const __m512 s = sigmoid16_of(_mm512_loadu_ps(x + i), with_x);
        _mm512_storeu_ps(y + i, u ? _mm512_mul_ps(s, _mm512_loadu_ps(u + i)) : s);
    }
#endif
    for (; i + 8 <= n; i += 8) {
        const v8 s = sigmoid_of(*(const v8 *)(x + i), with_x);
        *(v8 *)(y + i) = u ? s * *(const v8 *)(u + i) : s;
    }
    if (i == n) return;
    v8 xt = {0}, ut = {0};
    for (int64_t k = 0; i + k < n; k++) xt[k] = x[i + k], ut[k] = u ? u[i + k] : 0.0f;
    const v8 s = sigmoid_of(xt, with_x);
    for (int64_t k = 0; i + k < n; k++) y[i + k] = u ? s[k] * ut[k] : s[k];
}

/* Rope as the engine's RotaryEmbedding: with interleave the pairs are (x0, x1), (x2, x3), ...
 * and the output is de-interleaved; out = y * cos + swap(y) * sin. In place on x [R]. */
static void rope(float *x, const float *cos_row, const float *sin_row, int64_t r, int interleave) {
    float y1[256], y2[256];
    const int64_t h = r / 2;
    for (int64_t j = 0; j < h; j++) {
        y1[j] = interleave ? x[2 * j] : x[j];
        y2[j] = interleave ? x[2 * j + 1] : x[h + j];
    }
    for (int64_t j = 0; j < h; j++) {
        x[j] = y1[j] * cos_row[j] + y2[j] * sin_row[j];
        x[h + j] = y2[j] * cos_row[h + j] + y1[j] * sin_row[h + j];
    }
}

static inline float hsum(v8 v) {
    float sum = 0.0f;
    for (int j = 0; j < 8; j++) sum += v[j];
    return sum;
}

/* The sum of a's lanes in the order hsums adds them: ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)). */
static inline float lane_sum(v8 a) {
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

/* The lane sums of 8 vectors at once, as one vector: (lane_sum(a[0]), ..., lane_sum(a[7])),
 * bit for bit. A tree of pairwise adds costs 8 ops where 8 separate sums cost ~80. */
static inline v8 hsums(const v8 a[8]) {
#ifdef __AVX__
    const __m256 t0 = _mm256_hadd_ps((__m256)a[0], (__m256)a[1]);
    const __m256 t1 = _mm256_hadd_ps((__m256)a[2], (__m256)a[3]);
    const __m256 t2 = _mm256_hadd_ps((__m256)a[4], (__m256)a[5]);
    const __m256 t3 = _mm256_hadd_ps((__m256)a[6], (__m256)a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return (v8)_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                             _mm256_permute2f128_ps(u0, u1, 0x31));
#else
    v8 out;
    for (int j = 0; j < 8; j++) out[j] = lane_sum(a[j]);
    return out;
#endif
}

/* Keep v in a register: a vector used by several FMAs is loaded once, where the compiler would
 * fold a load into each of them (twice the loads, and the loops here are bound by loads). With
 * the max of softmax_numerators in 8 lanes: 32 decodes of `small` at context 320, the scores and
 * sums with the cache hot, fp32 9.6-10.6 -> 7.8-8.6 ms, bf16 8.0-8.3 -> 7.4-7.8 (cold, fp32
 * 11.1-11.8 -> 10.2-10.4, bf16 unchanged at 8.7-8.8: bound by reading the cache). */
#ifdef __AVX__
#define in_register(v) __asm__("" : "+x"(v))
#else /* no vector register class to name (SSE-only x86 splits v8 in two; other ISAs) */
#define in_register(v) ((void)0)
#endif

/* y[:n] += a * x[:n] */
static inline void axpy(float *y, float a, const kt *x, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) *(v8 *)(y + i) += a * load8(x + i);
    for (; i < n; i++) y[i] += a * load1(x + i);
}

/* s[2m + i] = q[m] . row_i for 4 queries and the rows r0, r1: sums in 8 lanes, in order, then
 * their lane_sum, then the tail in order. Each load feeds 2-4 products. */
static inline void score_tile(const float *const q[4], const kt *r0, const kt *r1, int64_t n,
                              float s[8]) {
    const int64_t nv = n / 8 * 8;
    v8 a[8] = {{0}}; /* a[2m + i]: query m, row i */
    for (int64_t i = 0; i < nv; i += 8) {
        v8 k0 = load8(r0 + i), k1 = load8(r1 + i);
        in_register(k0);
        in_register(k1);
        _Pragma("GCC unroll 4") for (int m = 0; m < 4; m++) {
            v8 qv = *(const v8 *)(q[m] + i);
            in_register(qv);
            a[2 * m] += qv * k0, a[2 * m + 1] += qv * k1;
        }
    }
    const v8 sum = hsums(a);
    for (int j = 0; j < 8; j++) s[j] = sum[j];
    for (int64_t i = nv; i < n; i++) {
        const float k0 = load1(r0 + i), k1 = load1(r1 + i);
        for (int m = 0; m < 4; m++) s[2 * m] += q[m][i] * k0, s[2 * m + 1] += q[m][i] * k1;
    }
}

/* out[j * ld + r] = q_j . row_r for queries q_j = q + j * n (j < nh) and cache rows
 * row_r = rows + r * n (r < ns), by tiles of 4 queries x 2 rows, padded (a query or row repeated)
 * where fewer are left: every score comes from the same instructions in the same tile code, so a
 * score does not depend on how many heads a batch gave a work item (separate code for the
 * leftovers, written to the same order, was compiled to other roundings). The rows come from
 * memory (each sequence's own cache): a pair of rows is scored against all queries at once while
 * the same pair of `next` (the block after, or NULL) is fetched. Measured on 384 contexts of 320
 * rows in random blocks, 2 threads, 8 queries: 43-51 us a context -> 32-36 (the queries' groups
 * outside the rows, with the fetches in the first group only, read a block and then computed
 * half of it; a plain read of the same blocks takes 27). */
static void score_rows(const float *q, int64_t nh, int64_t n, const kt *rows, int64_t ns,
                       float *out, int64_t ld, const kt *next) {
    for (int64_t r = 0; r < ns; r += 2) {
        const int pair = r + 1 < ns;
        if (next) fetch(next + r * n, (1 + pair) * n);
        const kt *r0 = rows + r * n;
        for (int64_t j = 0; j < nh; j += 4) {
            const int64_t nq = MIN(4, nh - j);
            const float *qs[4];
            for (int m = 0; m < 4; m++) qs[m] = q + (j + MIN(m, nq - 1)) * n;
            float s[8];
            score_tile(qs, r0, pair ? r0 + n : r0, n, s);
            for (int64_t m = 0; m < nq; m++) {
                out[(j + m) * ld + r] = s[2 * m];
                if (pair) out[(j + m) * ld + r + 1] = s[2 * m + 1];
            }
        }
    }
}

/* acc_j[:L] += sum_r p[j * ld + r] * row_r[:L] for j < nh, r < ns (rows `stride` apart): tiles of
 * 4 heads x 16 columns kept in registers over the rows, so a row's load feeds 4 heads. */
static void weigh_rows(const float *p, int64_t nh, int64_t ld, const kt *rows, int64_t stride,
                       int64_t ns, float *acc, int64_t L) {
    const int64_t l16 = L / 16 * 16;
    int64_t j = 0;
    for (; j + 4 <= nh; j += 4) {
        const float *p0 = p + j * ld, *p1 = p0 + ld, *p2 = p1 + ld, *p3 = p2 + ld;
        float *y0 = acc + j * L, *y1 = y0 + L, *y2 = y1 + L, *y3 = y2 + L;
        for (int64_t c = 0; c < l16; c += 16) {
            v8 a0 = *(v8 *)(y0 + c), b0 = *(v8 *)(y0 + c + 8), a1 = *(v8 *)(y1 + c),
               b1 = *(v8 *)(y1 + c + 8), a2 = *(v8 *)(y2 + c), b2 = *(v8 *)(y2 + c + 8),
               a3 = *(v8 *)(y3 + c), b3 = *(v8 *)(y3 + c + 8);
            for (int64_t r = 0; r < ns; r++) {
                const kt *row = rows + r * stride + c;
                v8 lo = load8(row), hi = load8(row + 8);
                in_register(lo);
                in_register(hi);
                a0 += p0[r] * lo, b0 += p0[r] * hi, a1 += p1[r] * lo, b1 += p1[r] * hi;
                a2 += p2[r] * lo, b2 += p2[r] * hi, a3 += p3[r] * lo, b3 += p3[r] * hi;
            }
            *(v8 *)(y0 + c) = a0, *(v8 *)(y0 + c + 8) = b0, *(v8 *)(y1 + c) = a1;
            *(v8 *)(y1 + c + 8) = b1, *(v8 *)(y2 + c) = a2, *(v8 *)(y2 + c + 8) = b2;
            *(v8 *)(y3 + c) = a3, *(v8 *)(y3 + c + 8) = b3;
        }
        if (l16 < L)
            for (int m = 0; m < 4; m++)
                for (int64_t r = 0; r < ns; r++)
                    axpy(acc + (j + m) * L + l16, p[(j + m) * ld + r], rows + r * stride + l16, L - l16);
    }
    for (; j < nh; j++)
        for (int64_t r = 0; r < ns; r++) axpy(acc + j * L, p[j * ld + r], rows + r * stride, L);
}

#ifdef PD_DP
/* ---- the absorbed attention by native bf16 dot products (PD_DP) ---------------------------- *
 * A query and a cache row meet in one dot product of E elements (the scores), a head's
 * probabilities weigh the rows' latents (the sums): both by vdpbf16ps, the queries and the
 * probabilities rounded to bf16 (as a bf16 flash attention rounds P before P @ V), the cache
 * rows as stored, every sum fp32. Each score and each sum comes from the same instructions
 * whatever the batch, as in the fp32 form. Measured on `small` (32 decodes at context 320, bf16,
 * 2 threads, 3 alternating runs): the absorbed region 5.0-5.9 -> 3.4-3.5 ms, the layers 19.8-23.0
 * -> 17.9-19.2 ms. (The first version kept the sums' 16 registers on the stack, the tile loops not
 * unrolled: 5.3 -> 4.9 ms.) The expanded form (prefill chunks) keeps the widening kernels: with
 * dot products (64-element keys, 32-element values) a prefill of 8 x 256 tokens was no faster. */

/* The lane sums of 8 vectors of 16 lanes: the 256-bit halves added, then hsums. */
static inline v8 hsums16(const __m512 a[8]) {
    v8 h[8];
    _Pragma("GCC unroll 8") for (int m = 0; m < 8; m++)
        h[m] = (v8)_mm256_add_ps(_mm512_castps512_ps256(a[m]),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[m]), 1)));
    return hsums(h);
}

/* out[j * ld + r] = q_j . row_r as score_rows, for bf16 queries q_j = qb + j * ldq (zero past n,
 * ldq a multiple of 32): tiles of 4 queries x 2 rows, 32 elements a product. */
static void score_rows_dp(const uint16_t *qb, int64_t ldq, int64_t nh, int64_t n,
                          const uint16_t *rows, int64_t ns, float *out, int64_t ld,
                          const uint16_t *next) {
    for (int64_t r = 0; r < ns; r += 2) {
        const int pair = r + 1 < ns;
        if (next) fetch(next + r * n, (1 + pair) * n);
        const uint16_t *r0 = rows + r * n, *r1 = pair ? r0 + n : r0;
        for (int64_t j = 0; j < nh; j += 4) {
            const int64_t nq = MIN(4, nh - j);
            const uint16_t *qs[4];
            for (int m = 0; m < 4; m++) qs[m] = qb + (j + MIN(m, nq - 1)) * ldq;
            __m512 a[8];
            _Pragma("GCC unroll 8") for (int m = 0; m < 8; m++) a[m] = _mm512_setzero_ps();
            for (int64_t i = 0; i < n; i += 32) {
                const __mmask32 mask = cols_mask(n - i);
                const __m512bh k0 = (__m512bh)_mm512_maskz_loadu_epi16(mask, r0 + i);
                const __m512bh k1 = (__m512bh)_mm512_maskz_loadu_epi16(mask, r1 + i);
                _Pragma("GCC unroll 4") for (int m = 0; m < 4; m++) {
                    const __m512bh qv = (__m512bh)_mm512_loadu_si512(qs[m] + i);
                    a[2 * m] = _mm512_dpbf16_ps(a[2 * m], qv, k0);
                    a[2 * m + 1] = _mm512_dpbf16_ps(a[2 * m + 1], qv, k1);
                }
            }
            const v8 s = hsums16(a);
            for (int64_t m = 0; m < nq; m++) {
                out[(j + m) * ld + r] = s[2 * m];
                if (pair) out[(j + m) * ld + r + 1] = s[2 * m + 1];
            }
        }
    }
}

/* out[j * ldo + c] = sum_s p_j[s] row_s[c] for j < nh, c < L, s < ns, row_s the sequence's cache
 * row s (blocks `table` of BS rows, BS a power of two, E elements a row) and p_j = pb + j * ldp
 * in bf16 (zero at ns when ns is odd): the rows taken in pairs, interleaved into the pairs a dot
 * product wants, tiles of 4 heads x 64 columns in registers over all the rows (the context was
 * just scored: in L2). */
static void weigh_rows_dp(const uint16_t *pb, int64_t ldp, int64_t nh, const uint16_t *kv_cache,
                          const int32_t *table, int64_t BS, int64_t E, int64_t ns, float *out,
                          int64_t ldo, int64_t L) {
    const int shift = __builtin_ctzll((unsigned long long)BS);
#define DP_ROW(s) (kv_cache + ((int64_t)table[(s) >> shift] * BS + ((s) & (BS - 1))) * E)
    for (int64_t j = 0; j < nh; j += 4) {
        const int64_t nq = MIN(4, nh - j);
        const uint16_t *ps[4];
        for (int m = 0; m < 4; m++) ps[m] = pb + (j + MIN(m, nq - 1)) * ldp;
        for (int64_t c = 0; c < L; c += 64) {
            __m512 acc[4][2][2]; /* fully unrolled below: kept in registers */
            __mmask32 mask[2];
            _Pragma("GCC unroll 2") for (int b = 0; b < 2; b++) mask[b] = cols_mask(L - c - 32 * b);
            _Pragma("GCC unroll 4") for (int m = 0; m < 4; m++)
                _Pragma("GCC unroll 2") for (int b = 0; b < 2; b++) acc[m][b][0] = acc[m][b][1] = _mm512_setzero_ps();
            for (int64_t s = 0; s < ns; s += 2) {
                const uint16_t *r0 = DP_ROW(s) + c, *r1 = s + 1 < ns ? DP_ROW(s + 1) + c : r0;
                __m512bh pv[4];
                _Pragma("GCC unroll 4") for (int m = 0; m < 4; m++) pv[m] = x_pair(ps[m], s);
                _Pragma("GCC unroll 2") for (int b = 0; b < 2; b++) {
                    const __m512i a0 = _mm512_maskz_loadu_epi16(mask[b], r0 + 32 * b);
                    const __m512i a1 = _mm512_maskz_loadu_epi16(mask[b], r1 + 32 * b);
                    const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a0, a1);
                    const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(a0, a1);
                    _Pragma("GCC unroll 4") for (int m = 0; m < 4; m++) {
                        acc[m][b][0] = _mm512_dpbf16_ps(acc[m][b][0], lo, pv[m]);
                        acc[m][b][1] = _mm512_dpbf16_ps(acc[m][b][1], hi, pv[m]);
                    }
                }
            }
            _Pragma("GCC unroll 4") for (int m = 0; m < 4; m++)
                _Pragma("GCC unroll 2") for (int b = 0; b < 2; b++) {
                    const int64_t left = L - c - 32 * b;
                    if (m < nq && left > 0)
                        store_chunk(out + (j + m) * ldo + c + 32 * b, acc[m][b][0], acc[m][b][1], left);
                }
        }
    }
#undef DP_ROW
}
#endif

/* dst[:n] = src[:n] as cache elements */
static inline void store_row(kt *dst, const float *src, int64_t n) {
#ifdef PD_BF16
    for (int64_t i = 0; i < n; i++) dst[i] = to_bf16(src[i]);
#else
    memcpy(dst, src, n * sizeof(float));
#endif
}

#ifdef PD_BF16
/* 16 floats in vector registers (one AVX-512 register, or two of v8's) */
typedef float v16 __attribute__((vector_size(64), aligned(4)));

/* Y[t, c:c + 64] for the NT <= 4 tokens at X (rows of k), summed in registers over all of k, each
 * row of W's 64 columns loaded once for all of them (one sequential stream through W). */
static inline __attribute__((always_inline)) void f32_block(const float *X, int64_t k,
                                                            const float *W, int64_t n, float *Y,
                                                            int64_t c, const int NT) {
    v16 a[4][4];
    _Pragma("GCC unroll 4") for (int t = 0; t < NT; t++)
        _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) a[t][j] = (v16){0};
    for (int64_t i = 0; i < k; i++) {
        const float *w = W + i * n + c;
        const v16 w0 = *(const v16 *)w, w1 = *(const v16 *)(w + 16), w2 = *(const v16 *)(w + 32),
                  w3 = *(const v16 *)(w + 48);
        _Pragma("GCC unroll 4") for (int t = 0; t < NT; t++) {
            const float xv = X[t * k + i];
            a[t][0] += xv * w0, a[t][1] += xv * w1, a[t][2] += xv * w2, a[t][3] += xv * w3;
        }
    }
    _Pragma("GCC unroll 4") for (int t = 0; t < NT; t++)
        _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) *(v16 *)(Y + t * n + c + 16 * j) = a[t][j];
}

/* Y [T, n] = X [T, k] @ W [k, n] for fp32 weights in a bf16 build (the routers): 4 tokens x 64
 * columns at a time, so 16 sums are in flight where a token's 32 columns (4 sums) each waited on
 * its last add, and W is read as whole rows (every sum still in k order: the same bits). `small`
 * bf16, 32 decodes at context 320, 2 alternating runs: the 11 routers 0.42-0.48 -> 0.24-0.27 ms a
 * forward; alone, 512 x 64, 2 threads: 25-38 -> 14 us warm, 58-64 -> 27-39 cold. */
static void matmul_f32(const float *X, const float *W, float *Y, int64_t T, int64_t k, int64_t n,
                       int nt) {
#pragma omp parallel for num_threads(row_threads(T, k * n / 8, nt))
    for (int64_t t0 = 0; t0 < T; t0 += 4) {
        const int64_t m = MIN(4, T - t0);
        const float *x = X + t0 * k;
        float *y = Y + t0 * n;
        int64_t c = 0;
        for (; c + 64 <= n; c += 64) switch (m) {
            case 1: f32_block(x, k, W, n, y, c, 1); break;
            case 2: f32_block(x, k, W, n, y, c, 2); break;
            case 3: f32_block(x, k, W, n, y, c, 3); break;
            default: f32_block(x, k, W, n, y, c, 4); break;
            }
        for (int64_t t = 0; t < m; t++)
            for (int64_t cc = c; cc < n; cc++) {
                float acc = 0.0f;
                for (int64_t i = 0; i < k; i++) acc += x[t * k + i] * W[i * n + cc];
                y[t * n + cc] = acc;
            }
    }
}
#endif

#ifdef __AVX512F__
/* s[:n] = exp(scale s - max) in place (a row's softmax numerators); returns their sum. 16 lanes
 * at a time, a short tail masked; the numerators are those of the 8-lane form below bit for bit,
 * the sum adds them in another order. 1,536 rows of 320 (a step's rows of `small` for one of 2
 * threads), alone: 315-358 -> 161 us; `small` bf16, 32 decodes at context 320, the two forms
 * alternating forward by forward: 0.13-0.65 ms a forward less (4 rounds). */
static float softmax_numerators(float *s, int64_t n, float scale) {
    const __m512 scale16 = _mm512_set1_ps(scale);
    const __mmask16 tail = (__mmask16)((1u << (n % 16)) - 1);
    const int64_t whole = n / 16 * 16;
    __m512 top = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < whole; i += 16) {
        const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(s + i), scale16);
        _mm512_storeu_ps(s + i, v);
        top = _mm512_max_ps(top, v);
    }
    if (tail) {
        const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, s + whole), scale16);
        _mm512_mask_storeu_ps(s + whole, tail, v);
        top = _mm512_mask_max_ps(top, tail, top, v);
    }
    const __m512 best = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    for (int64_t i = 0; i < whole; i += 16) {
        const __m512 e = exp16_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + i), best));
        _mm512_storeu_ps(s + i, e);
        sum = _mm512_add_ps(sum, e);
    }
    if (tail) {
        const __m512 e = exp16_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + whole), best));
        _mm512_mask_storeu_ps(s + whole, tail, e);
        sum = _mm512_mask_add_ps(sum, tail, sum, e);
    }
    return _mm512_reduce_add_ps(sum);
}
#else
/* s[:n] = exp(scale s - max) in place (a row's softmax numerators); returns their sum. The max 8
 * lanes at a time (exact in any order), the sum in 8 lanes, then across them (hsum). */
static float softmax_numerators(float *s, int64_t n, float scale) {
    v8 top = (v8){0} - INFINITY;
    float best = -INFINITY;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const v8 v = *(v8 *)(s + i) * scale;
        const vi8 above = v > top;
        *(v8 *)(s + i) = v;
        top = (v8)((above & (vi8)v) | (~above & (vi8)top));
    }
    for (int k = 0; k < 8; k++) best = top[k] > best ? top[k] : best;
    for (; i < n; i++) {
        s[i] *= scale;
        best = s[i] > best ? s[i] : best;
    }
    v8 sum = {0}, tail = {0};
    for (i = 0; i + 8 <= n; i += 8) {
        const v8 e = exp_nonpositive(*(v8 *)(s + i) - best);
        *(v8 *)(s + i) = e;
        sum += e;
    }
    for (int64_t k = 0; i + k < n; k++) tail[k] = s[i + k] - best;
    tail = exp_nonpositive(tail);
    for (int64_t k = 0; i + k < n; k++) sum[k] += s[i + k] = tail[k];
    return hsum(sum);
}
#endif

/* ---------------------------------------------------------------- attention ---------------- */
typedef struct {
    const int64_t *positions, *slot_mapping, *token_seq;
    const int32_t *block_tables;
    int64_t block_table_stride;
    const float *rope_cos, *rope_sin; /* [max_pos, R] */
} pd_batch;

enum { EXPAND_MIN_RUN = 16, QUERY_BLOCK = 8 };

/* Row s of a sequence's cache (blocks `table`, BS rows of E elements each). */
static inline const kt *cache_row(const kt *kv_cache, const int32_t *table, int64_t BS, int64_t E,
                                  int64_t s) {
    return kv_cache + ((int64_t)table[s / BS] * BS + s % BS) * E;
}

/* The end of the run of tokens from t0 in t0's sequence (a batch keeps a sequence together). */
static inline int64_t run_end(const pd_batch *b, int64_t T, int64_t t0) {
    int64_t t1 = t0 + 1;
    while (t1 < T && b->token_seq[t1] == b->token_seq[t0]) t1++;
    return t1;
}

/* Whether a run of n new tokens attends in the expanded form (attend_expanded). */
static inline int expanded(const pd_layer *l, int64_t n) { return l->kv_b && n >= EXPAND_MIN_RUN; }

/* Attention of tokens [t0, t1), a run of one sequence's new tokens (a prefill chunk), in the
 * expanded form: the context's cached latents are expanded by kv_b once into each head's keys
 * [k_nope, k_pe] and values, which the queries [q_nope, rope(q_pe)] then attend to directly. A
 * query and a cached row cost H (N + R + V) products where the absorbed form costs H (2 L + R)
 * (`small`: 768 against 2,304), and each row H L (N + V) once. A query sees the rows up to its
 * position (the causal mask: the probabilities past it are exact zeros), so its result does not
 * depend on the other queries of its block. Out: o [t, H, V] for t in [t0, t1). Measured on
 * `small`, a prefill of 8 x 256 tokens (fp32, 2 threads, medians of 5 alternating forwards):
 * 1,228 -> 1,109 ms, the attention (latent queries, scores and sums, values) 357 -> 165 ms. */
static void attend_expanded(const pd_dims *d, const pd_layer *l, const pd_batch *b,
                            const kt *kv_cache, const float *q, int64_t t0, int64_t t1, float *o) {
    const int64_t H = d->num_heads, N = d->nope_dim, R = d->rope_dim, L = d->kv_lora_rank,
                  V = d->v_dim, E = L + R, BS = d->block_size, K = N + R, QW = H * K,
                  KW = H * (N + V), Q = t1 - t0, S = b->positions[t1 - 1] + 1;
    const int nt = (int)d->num_threads;
    const int32_t *table = b->block_tables + b->token_seq[t0] * b->block_table_stride;
    float *lat = malloc(sizeof(float) * (S * L + S * KW + H * Q * K));
    kt *keys = malloc(sizeof(kt) * H * S * (K + V)); /* [H, S, K] then the values [H, S, V] */
    if (!lat || !keys) abort();
    float *kvx = lat + S * L, *qs = kvx + S * KW; /* [S, H (N + V)], [H, Q, K] */
    kt *vals = keys + H * S * K;
#pragma omp parallel for num_threads(row_threads(S, L, nt))
    for (int64_t s = 0; s < S; s++) { /* the cached latents, widened */
        const kt *row = cache_row(kv_cache, table, BS, E, s);
        for (int64_t i = 0; i < L; i++) lat[s * L + i] = load1(row + i);
    }
    matmul(lat, l->kv_b, kvx, S, L, KW, nt);
#pragma omp parallel num_threads(nt)
    {
#pragma omp for schedule(static)
        for (int64_t hd = 0; hd < H; hd++) { /* each head's keys, values and queries, rows apart */
            for (int64_t s = 0; s < S; s++) {
                const float *kv = kvx + s * KW + hd * (N + V);
                kt *key = keys + (hd * S + s) * K;
                store_row(key, kv, N);
                memcpy(key + N, cache_row(kv_cache, table, BS, E, s) + L, R * sizeof(kt));
                store_row(vals + (hd * S + s) * V, kv + N, V);
            }
            for (int64_t j = 0; j < Q; j++) {
                float *qq = qs + (hd * Q + j) * K;
                const int64_t pos = b->positions[t0 + j];
                memcpy(qq, q + (t0 + j) * QW + hd * K, K * sizeof(float));
                rope(qq + N, b->rope_cos + pos * R, b->rope_sin + pos * R, R,
                     (int)d->rope_interleave);
            }
        }
        const int64_t blocks = (Q + QUERY_BLOCK - 1) / QUERY_BLOCK;
        float *scores = malloc(sizeof(float) * QUERY_BLOCK * S);
        float *acc = malloc(sizeof(float) * QUERY_BLOCK * V);
        if (!scores || !acc) abort();
#pragma omp for schedule(dynamic)
        for (int64_t item = 0; item < H * blocks; item++) { /* the last (longest) blocks first */
            const int64_t hd = item % H, j0 = (blocks - 1 - item / H) * QUERY_BLOCK;
            const int64_t nq = MIN(QUERY_BLOCK, Q - j0), ns = b->positions[t0 + j0 + nq - 1] + 1;
            float total[QUERY_BLOCK];
            score_rows(qs + (hd * Q + j0) * K, nq, K, keys + hd * S * K, ns, scores, ns, NULL);
            for (int64_t j = 0; j < nq; j++) {
                const int64_t seen = b->positions[t0 + j0 + j] + 1;
                total[j] = softmax_numerators(scores + j * ns, seen, d->attn_scale);
                memset(scores + j * ns + seen, 0, sizeof(float) * (ns - seen));
            }
            memset(acc, 0, sizeof(float) * nq * V);
            weigh_rows(scores, nq, ns, vals + hd * S * V, V, ns, acc, V);
            for (int64_t j = 0; j < nq; j++)
                for (int64_t i = 0; i < V; i++)
                    o[((t0 + j0 + j) * H + hd) * V + i] = acc[j * V + i] / total[j];
        }
        free(scores);
        free(acc);
    }
    free(lat);
    free(keys);
}

/* x [T, D] -> attention output added to x (the residual). */
static void attention(const pd_dims *d, const pd_layer *l, const pd_batch *b, kt *kv_cache,
                      float *x, int64_t T, float *h, float *work) {
    const int64_t D = d->hidden, H = d->num_heads, N = d->nope_dim, R = d->rope_dim,
                  L = d->kv_lora_rank, V = d->v_dim, QL = d->q_lora_rank, E = L + R,
                  QW = H * (N + R), BS = d->block_size;
    const int nt = (int)d->num_threads;
    float *q = work;              /* [T, H, N + R] */
    float *kva = q + T * QW;      /* [T, L + R] */
    float *qcat = kva + T * E;    /* [T, H, L + R]: latent query, rotated rope query; then [:L]
                                   * holds the head's latent output */
    float *o = qcat + T * H * E;  /* [T, H, V] */
    float *qa = o + T * H * V;    /* [T, QL] */

    /* threaded from 8 tokens on like the MoE's sums before it, which leave each thread the rows
     * it reads here (the same static split): 0.10-0.31 ms less a 32-decode forward of `small`
     * (6 of 7 rounds alternating forward by forward) */
#pragma omp parallel for num_threads(T >= 8 ? nt : 1)
    for (int64_t t = 0; t < T; t++) rms_norm(x + t * D, l->input_norm, h + t * D, D, d->rms_eps);
    const mm_job first[2] = {QL ? (mm_job){l->q_a, qa, QL} : (mm_job){l->q_proj, q, QW},
                             {l->kv_a, kva, E}}; /* both read h: one parallel region */
    matmuls(h, T, D, first, 2, nt);
    add_bias(kva, l->kv_a_bias, T, E);
    if (QL) {
        add_bias(qa, l->q_a_bias, T, QL);
#pragma omp parallel for num_threads(row_threads(T, QL, nt))
        for (int64_t t = 0; t < T; t++) rms_norm(qa + t * QL, l->q_a_norm, qa + t * QL, QL, d->latent_eps);
        matmul(qa, l->q_b, q, T, QL, QW, nt);
    }
#pragma omp parallel for num_threads(row_threads(T, E, nt))
    for (int64_t t = 0; t < T; t++) { /* the tokens' cache entries: [norm(latent), rope(k_pe)] */
        float *entry = kva + t * E; /* built in place, then stored */
        rms_norm(entry, l->kv_a_norm, entry, L, d->latent_eps);
        const int64_t pos = b->positions[t];
        rope(entry + L, b->rope_cos + pos * R, b->rope_sin + pos * R, R, (int)d->rope_interleave);
        store_row(kv_cache + b->slot_mapping[t] * E, entry, E);
    }
    /* A run of EXPAND_MIN_RUN or more new tokens of one sequence (a prefill chunk) attends in the
     * expanded form (attend_expanded), the others (decodes, speculative verify rows: at most 9 a
     * sequence) in the absorbed form: by the run's own length, so that a row computes the same
     * beside any other rows. ab[:A]: the absorbed tokens in order. */
    int64_t *ab = malloc(sizeof(int64_t) * T), A = 0;
    if (!ab) abort();
    for (int64_t t0 = 0, t1; t0 < T; t0 = t1) {
        t1 = run_end(b, T, t0);
        if (!expanded(l, t1 - t0))
            for (int64_t t = t0; t < t1; t++) ab[A++] = t;
    }
    const int packed = A < T; /* some tokens expanded: row i of qcat and o is token ab[i] */
    /* Three passes in one parallel region: each head's latent query (q_nope @ w_uk[h]) and rotated
     * rope query for all the absorbed tokens; the scores and sums, a work item being a token's
     * heads [h0, h1) (with fewer tokens than threads the heads are split); each head's values
     * (latent @ w_uv[h]) for all of them. The per-head products thus see every token at once
     * (measured on `small`, 32 decodes at context 320, against one token at a time inside the work
     * items: this region 18.0 -> 17.0 ms fp32, 10.4 -> 9.2 bf16). Threads only when the scores and
     * sums are worth waking them for. */
    int64_t macs = 0;
    for (int64_t i = 0; i < A; i++) macs += (b->positions[ab[i]] + 1) * H * (E + L);
    const int64_t groups = A >= nt ? 1 : MIN(H, nt), per = (H + groups - 1) / groups;
#pragma omp parallel num_threads(A * groups > 1 && macs >= PAR_MIN_MACS ? nt : 1)
    if (A > 0) {
        float *qn = packed ? malloc(sizeof(float) * A * N) : NULL; /* a head's q_nope rows */
#pragma omp for schedule(static)
        for (int64_t hd = 0; hd < H; hd++) {
            const float *qh = q + hd * (N + R);
            int64_t ldq = QW;
            if (qn) {
                for (int64_t i = 0; i < A; i++)
                    memcpy(qn + i * N, qh + ab[i] * QW, N * sizeof(float));
                qh = qn, ldq = N;
            }
            panel_cols(qh, ldq, l->w_uk + hd * panels_elems(N, L), N, qcat + hd * E, H * E, A, 0, L);
            for (int64_t i = 0; i < A; i++) {
                float *qr = qcat + (i * H + hd) * E + L;
                const int64_t pos = b->positions[ab[i]];
                memcpy(qr, q + ab[i] * QW + hd * (N + R) + N, R * sizeof(float));
                rope(qr, b->rope_cos + pos * R, b->rope_sin + pos * R, R, (int)d->rope_interleave);
            }
        }
        free(qn);
        int64_t cap = 0;
        float *scores = NULL, *acc = malloc(sizeof(float) * per * L);
#ifdef PD_DP
        int64_t bcap = 0;
        uint16_t *qb = NULL; /* the queries, then the probabilities, in bf16 */
#endif
#pragma omp for schedule(dynamic)
        for (int64_t item = 0; item < A * groups; item++) {
            const int64_t i = item / groups, t = ab[i], h0 = (item % groups) * per,
                          h1 = MIN(H, h0 + per);
            const int64_t ctx = b->positions[t] + 1, nh = h1 - h0;
            float *qc = qcat + (i * H + h0) * E;
            if (nh * ctx > cap) {
                free(scores);
                cap = MIN(nh * ctx * 2, nh * ctx + (1 << 20));
                scores = malloc(sizeof(float) * cap);
            }
            const int32_t *table = b->block_tables + b->token_seq[t] * b->block_table_stride;
            float total[256]; /* per head: the softmax sum */
#ifdef PD_DP
            const int64_t EP = (E + 31) / 32 * 32, cp = (ctx + 1) / 2 * 2;
            if (nh * (EP + cp) > bcap) {
                free(qb);
                bcap = MIN(nh * (EP + cp) * 2, nh * (EP + cp) + (1 << 20));
                qb = malloc(sizeof(uint16_t) * bcap);
                if (!qb) abort();
            }
            uint16_t *pb = qb + nh * EP;
            round_rows(qc, E, nh, E, EP, qb); /* the queries in bf16, zero to EP */
            for (int64_t s0 = 0; s0 < ctx; s0 += BS)
                score_rows_dp(qb, EP, nh, E, kv_cache + (int64_t)table[s0 / BS] * BS * E,
                              MIN(BS, ctx - s0), scores + s0, ctx,
                              s0 + BS < ctx ? kv_cache + (int64_t)table[s0 / BS + 1] * BS * E : NULL);
            for (int64_t j = 0; j < nh; j++)
                total[j] = softmax_numerators(scores + j * ctx, ctx, d->attn_scale);
            round_rows(scores, ctx, nh, ctx, cp, pb); /* the probabilities, zero to cp */
            weigh_rows_dp(pb, cp, nh, kv_cache, table, BS, E, ctx, acc, L, L);
#else
            for (int64_t s0 = 0; s0 < ctx; s0 += BS) /* scores, block by block */
                score_rows(qc, nh, E, kv_cache + (int64_t)table[s0 / BS] * BS * E,
                           MIN(BS, ctx - s0), scores + s0, ctx,
                           s0 + BS < ctx ? kv_cache + (int64_t)table[s0 / BS + 1] * BS * E : NULL);
            for (int64_t j = 0; j < nh; j++)
                total[j] = softmax_numerators(scores + j * ctx, ctx, d->attn_scale);
            memset(acc, 0, sizeof(float) * nh * L);
            for (int64_t s0 = 0; s0 < ctx; s0 += BS) /* probabilities @ latents */
                weigh_rows(scores + s0, nh, ctx, kv_cache + (int64_t)table[s0 / BS] * BS * E, E,
                           MIN(BS, ctx - s0), acc, L);
#endif
            for (int64_t j = 0; j < nh; j++) /* normalise: sum_s p_s c_s / sum_s p_s, over qc */
                for (int64_t c = 0; c < L; c++) qc[j * E + c] = acc[j * L + c] / total[j];
        }
        free(scores);
        free(acc);
#ifdef PD_DP
        free(qb);
#endif
#pragma omp for schedule(static)
        for (int64_t hd = 0; hd < H; hd++) /* values: latent [L] @ w_uv[h] [L, V] */
            panel_cols(qcat + hd * E, H * E, l->w_uv + hd * panels_elems(L, V), L, o + hd * V,
                       H * V, A, 0, V);
    }
    for (int64_t i = A - 1; packed && i >= 0; i--) /* to the tokens' rows (ab[i] >= i) */
        memmove(o + ab[i] * H * V, o + i * H * V, H * V * sizeof(float));
    free(ab);
    for (int64_t t0 = 0, t1; t0 < T; t0 = t1) {
        t1 = run_end(b, T, t0);
        if (expanded(l, t1 - t0)) attend_expanded(d, l, b, kv_cache, q, t0, t1, o);
    }
    matmul(o, l->o_proj, h, T, H * V, D, nt);
    add_bias(h, l->o_bias, T, D);
    for (int64_t i = 0; i < T * D; i++) x[i] += h[i];
}

/* ---------------------------------------------------------------- MLPs --------------------- */
/* out [T, D] = down(silu(x @ gate) * (x @ up)), W [D, I], [D, I], [I, D]; `act` [T, 2I] work. */
static void swiglu(const float *x, const wt *gate, const wt *up, const wt *down,
                   float *out, int64_t T, int64_t D, int64_t I, float *act, int nt) {
    float *g = act, *u = act + T * I;
    const mm_job gate_up[2] = {{gate, g, I}, {up, u, I}};
    matmuls(x, T, D, gate_up, 2, nt);
#pragma omp parallel for num_threads(row_threads(T, I, nt))
    for (int64_t t = 0; t < T; t++) sigmoid_rows(g + t * I, u + t * I, g + t * I, I, 1);
    matmul(g, down, out, T, I, D, nt);
}

/* Top `k` of v[n] (largest first, lower index on ties) into idx: one pass, each value placed in
 * the sorted list of the best so far (after its equals). */
static void top_indices_scan(const float *v, int64_t n, int64_t k, int64_t *idx) {
    int64_t have = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t p = have;
        while (p > 0 && v[i] > v[idx[p - 1]]) p--;
        if (p >= k) continue;
        if (have < k) have++;
        for (int64_t m = have - 1; m > p; m--) idx[m] = idx[m - 1];
        idx[p] = i;
    }
}

/* top_indices_scan's choice by k sweeps of 16 lanes where the CPU has AVX-512 (n <= 512): the
 * largest value not yet taken, then the lowest untaken index holding it. No data-dependent branch
 * per value, where the scan mispredicts its insertions. A 32-decode step's picks of `small` (352
 * tokens' top 2 of each group of 8 and top 4 of 64), one thread: 277-298 -> 52-60 us; the same
 * indices for 2.68M random picks with ties, infinities and signed zeros. */
static void top_indices(const float *v, int64_t n, int64_t k, int64_t *idx) {
#ifdef __AVX512F__
    enum { MOST = 512 };
    if (n <= MOST) {
        __mmask16 live[MOST / 16]; /* a chunk's lanes inside v and not taken yet */
        const int64_t chunks = (n + 15) / 16;
        for (int64_t c = 0; c < chunks; c++)
            live[c] = n - 16 * c >= 16 ? 0xffff : (__mmask16)((1u << (n - 16 * c)) - 1);
        for (int64_t j = 0; j < MIN(k, n); j++) {
            __m512 best = _mm512_set1_ps(-INFINITY);
            for (int64_t c = 0; c < chunks; c++)
                best = _mm512_mask_max_ps(best, live[c], best, _mm512_maskz_loadu_ps(live[c], v + 16 * c));
            const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(best));
            int64_t at = -1;
            for (int64_t c = 0; c < chunks && at < 0; c++) {
                const __mmask16 hit = _mm512_mask_cmp_ps_mask(live[c], _mm512_maskz_loadu_ps(live[c], v + 16 * c), top, _CMP_EQ_OQ);
                if (hit) at = 16 * c + __builtin_ctz(hit);
            }
            for (int64_t c = 0; c < chunks && at < 0; c++) /* NaN values only: the first untaken */
                if (live[c]) at = 16 * c + __builtin_ctz(live[c]);
            live[at / 16] &= (__mmask16)~(1u << (at % 16));
            idx[j] = at;
        }
        return;
    }
#endif
    top_indices_scan(v, n, k, idx);
}

/* Router of one token: weights [K] and logical experts [K] (`work`: 3E floats). */
static void route(const pd_dims *d, const pd_layer *l, const float *logits, float *weights,
                  int64_t *experts, float *work) {
    const int64_t E = d->n_experts, K = d->top_k, G = d->n_group, per = E / G;
    float *scores = work, *choice = work + E, *group_scores = work + 2 * E;
    sigmoid_rows(logits, NULL, scores, E, 0);
    for (int64_t e = 0; e < E; e++) choice[e] = scores[e] + l->router_bias[e];
    if (d->topk_group < G) { /* keep the experts of the best topk_group groups (top-2 sums) */
        int64_t pair[2], groups[64];
        for (int64_t g = 0; g < G; g++) {
            top_indices(choice + g * per, per, 2, pair);
            group_scores[g] = choice[g * per + pair[0]] + choice[g * per + pair[1]];
        }
        top_indices(group_scores, G, d->topk_group, groups);
        for (int64_t g = 0; g < G; g++) {
            int kept = 0;
            for (int64_t m = 0; m < d->topk_group; m++) kept |= groups[m] == g;
            if (!kept)
                for (int64_t e = g * per; e < (g + 1) * per; e++) choice[e] = -INFINITY;
        }
    }
    top_indices(choice, E, K, experts);
    float sum = 0.0f;
    for (int64_t k = 0; k < K; k++) sum += weights[k] = scores[experts[k]];
    for (int64_t k = 0; k < K; k++)
        weights[k] = (d->norm_topk_prob ? weights[k] / (sum + 1e-20f) : weights[k]) * d->routed_scaling;
}

/* x += routed experts + shared experts of norm(x) (already in h [T, D]). */
static void moe(const pd_dims *d, const pd_layer *l, const float *h, float *x, int64_t T,
                int64_t *load_counts, float *work) {
    const int64_t D = d->hidden, E = d->n_experts, K = d->top_k, I = l->moe_width,
                  P = l->num_slots, TK = T * K;
    const int nt = (int)d->num_threads;
    float *logits = work;             /* [T, E] */
    float *weights = logits + T * E;  /* [T, K] */
    float *pair_out = weights + TK;   /* [T * K, D]: each (token, expert) pair's output */
    float *shared = pair_out + TK * D; /* [T, D] */
    int64_t *slots = malloc(sizeof(int64_t) * (3 * TK + P + 1));
    int64_t *experts = slots + TK, *order = experts + TK, *start = order + TK;

#ifdef PD_BF16
    matmul_f32(h, l->router, logits, T, D, E, nt); /* the router stays fp32 */
#else
    matmul(h, l->router, logits, T, D, E, nt);
#endif
#pragma omp parallel for num_threads(row_threads(T, 64 * E, nt)) /* about 3 us a token */
    for (int64_t t = 0; t < T; t++) {
        float route_work[3 * E];
        route(d, l, logits + t * E, weights + t * K, experts + t * K, route_work);
        for (int64_t k = 0; k < K; k++) {
            const int64_t e = experts[t * K + k];
            slots[t * K + k] = l->replicas ? l->replicas[e * l->replicas_width + t % l->replica_counts[e]] : e;
        }
    }
    if (load_counts)
        for (int64_t n = 0; n < TK; n++) load_counts[l->moe_index * P + slots[n]]++;
    /* group the pairs by slot (counting sort, stable) */
    memset(start, 0, (P + 1) * sizeof(int64_t));
    for (int64_t n = 0; n < TK; n++) start[slots[n] + 1]++;
    for (int64_t p = 0; p < P; p++) start[p + 1] += start[p];
    {
        int64_t *fill = malloc(sizeof(int64_t) * P);
        memcpy(fill, start, P * sizeof(int64_t));
        for (int64_t n = 0; n < TK; n++) order[fill[slots[n]]++] = n;
        free(fill);
    }
    const int64_t SW = l->mlp_width; /* shared experts' width (0: none) */
    /* units: -1 the shared experts (all T tokens; the biggest, handed out first), p >= 0 slot p */
    const int64_t expert_macs = (TK * I + T * SW) * 3 * D; /* threads only when worth it */
#pragma omp parallel num_threads(TK + (SW > 0) > 1 && expert_macs >= PAR_MIN_MACS ? nt : 1)
    {
        const int64_t slot_floats = T * (2 * D + 3 * I), shared_floats = T * 3 * SW;
        float *rows = malloc(sizeof(float) * (slot_floats > shared_floats ? slot_floats : shared_floats));
#pragma omp for schedule(dynamic)
        for (int64_t p = -1; p < P; p++) {
            if (p < 0) {
                if (SW) swiglu(h, l->gate, l->up, l->down, shared, T, D, SW, rows, 1);
                continue;
            }
            const int64_t n = start[p + 1] - start[p];
            if (!n) continue;
            float *gate_up = rows + T * D, *hidden = gate_up + T * 2 * I, *out = hidden + T * I;
            for (int64_t r = 0; r < n; r++)
                memcpy(rows + r * D, h + (order[start[p] + r] / K) * D, D * sizeof(float));
            panel_cols(rows, D, l->w13 + p * panels_elems(D, 2 * I), D, gate_up, 2 * I, n, 0,
                       2 * I);
            for (int64_t r = 0; r < n; r++)
                sigmoid_rows(gate_up + r * 2 * I, gate_up + r * 2 * I + I, hidden + r * I, I, 1);
            panel_cols(hidden, I, l->w2 + p * panels_elems(I, D), I, out, D, n, 0, D);
            for (int64_t r = 0; r < n; r++)
                memcpy(pair_out + order[start[p] + r] * D, out + r * D, D * sizeof(float));
        }
        free(rows);
    }
    /* threaded from 8 tokens on, far below row_threads' bound: the pairs' outputs were written by
     * both threads, so the sums wait on a line from the other core at every few loads, and two
     * threads wait in parallel (32 decodes of `small`: 0.10-0.29 ms less a forward, 4 rounds
     * alternating forward by forward); the next layer's input norm splits the rows the same way */
#pragma omp parallel for num_threads(T >= 8 ? nt : 1)
    for (int64_t t = 0; t < T; t++) { /* x += the pairs' weighted sum (in k order) + shared */
        float acc[D];
        memset(acc, 0, sizeof(float) * D);
        for (int64_t k = 0; k < K; k++) {
            const float w = weights[t * K + k], *out = pair_out + (t * K + k) * D;
            for (int64_t j = 0; j < D; j++) acc[j] += w * out[j];
        }
        for (int64_t j = 0; j < D; j++) x[t * D + j] += SW ? acc[j] + shared[t * D + j] : acc[j];
    }
    free(slots);
}

/* ---------------------------------------------------------------- entry --------------------- */
/* Runs `num_layers` layers over x [T, D] in place, then the final norm (NULL: none). Layer i
 * uses the cache at kv_base + i * kv_layer_stride. load_counts [num_moe_layers, P] (NULL: not
 * recorded) counts the tokens routed to each slot, at each MoE layer's moe_index row. Returns 0,
 * or -1 when out of memory. */
int pd_forward_layers(const pd_dims *d, const pd_layer *layers, int64_t num_layers, float *x,
                      int64_t T, const int64_t *positions, const int64_t *slot_mapping,
                      const int64_t *token_seq, const int32_t *block_tables,
                      int64_t block_table_stride, const float *rope_cos, const float *rope_sin,
                      kt *kv_base, int64_t kv_layer_stride, int64_t *load_counts,
                      const float *final_norm) {
    const pd_batch b = {positions, slot_mapping, token_seq, block_tables, block_table_stride,
                        rope_cos, rope_sin};
    const int64_t D = d->hidden, H = d->num_heads, E = d->kv_lora_rank + d->rope_dim,
                  QW = H * (d->nope_dim + d->rope_dim), K = d->top_k, X = d->n_experts;
    int64_t widest = 0; /* the widest MLP of any layer (dense, shared or expert) */
    for (int64_t i = 0; i < num_layers; i++) {
        widest = layers[i].mlp_width > widest ? layers[i].mlp_width : widest;
        widest = layers[i].moe_width > widest ? layers[i].moe_width : widest;
    }
    const int64_t attn_floats = T * (QW + E + H * E + H * d->v_dim + d->q_lora_rank);
    const int64_t moe_floats = T * X + T * K + T * K * D + T * D + T * 2 * widest;
    const int64_t mlp_floats = T * D + T * 2 * widest;
    const int nt = (int)d->num_threads;
    int64_t most = attn_floats > moe_floats ? attn_floats : moe_floats;
    most = mlp_floats > most ? mlp_floats : most;
    float *h = malloc(sizeof(float) * (T * D + most));
    if (!h) return -1;
    float *work = h + T * D;
    for (int64_t i = 0; i < num_layers; i++) {
        const pd_layer *l = layers + i;
        attention(d, l, &b, kv_base + i * kv_layer_stride, x, T, h, work);
#pragma omp parallel for num_threads(row_threads(T, D, nt))
        for (int64_t t = 0; t < T; t++) rms_norm(x + t * D, l->post_norm, h + t * D, D, d->rms_eps);
        if (l->moe_index >= 0) {
            moe(d, l, h, x, T, load_counts, work);
        } else {
            float *out = work, *act = work + T * D;
            swiglu(h, l->gate, l->up, l->down, out, T, D, l->mlp_width, act, (int)d->num_threads);
#pragma omp parallel for num_threads(row_threads(T, D, nt))
            for (int64_t j = 0; j < T * D; j++) x[j] += out[j];
        }
    }
    if (final_norm) {
#pragma omp parallel for num_threads(row_threads(T, D, nt))
        for (int64_t t = 0; t < T; t++) rms_norm(x + t * D, final_norm, x + t * D, D, d->rms_eps);
    }
    free(h);
    return 0;
}

/* Y [T, n] = X [T, k] @ W [k, n] (a dense weight, pd_pack) with `nt` threads (the heads' logits,
 * the MTP input projection), each row of X first RMS-normed by `norm` [k] where given (NULL: as it
 * is), and X = cat(rms_norm(X [T, k/2]) * norm, rms_norm(X2 [T, k/2]) * norm2) where X2 is given
 * (the MTP block's input). Returns 0, or -1 when out of memory. */
int pd_matmul(const float *X, const float *X2, const wt *W, float *Y, int64_t T, int64_t k,
              int64_t n, int64_t nt, const float *norm, const float *norm2, float eps) {
    float *normed = NULL;
    if (norm) {
        normed = malloc(sizeof(float) * T * k);
        if (!normed) return -1;
        const int64_t w = X2 ? k / 2 : k;
        for (int64_t t = 0; t < T; t++) {
            rms_norm(X + t * w, norm, normed + t * k, w, eps);
            if (X2) rms_norm(X2 + t * w, norm2, normed + t * k + w, w, eps);
        }
        X = normed;
    }
    matmul(X, W, Y, T, k, n, (int)nt);
    free(normed);
    return 0;
}

/* Elements of W [k, n] in panels. */
int64_t pd_panels_size(int64_t k, int64_t n) { return panels_elems(k, n); }

/* out [pd_panels_size(k, n)] = W [k, n] in the build's panels (the linear weights in the build's
 * dtype, the experts' slots, the heads' absorbed slices). */
void pd_pack(const wt *W, int64_t k, int64_t n, wt *out) { pack_panels(W, k, n, out); }
