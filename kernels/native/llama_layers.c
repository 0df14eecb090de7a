/* Every decoder layer of a Llama forward in one call, bfloat16 on the CPU (gpu_worker/model.py).
 *
 * The same kernels, in the same order, as the per-layer Python loop (`LlamaModel._hidden_states_fused`):
 * RMSNorm with the residual add fused, the q/k/v product, RoPE, the K/V write into the paged cache,
 * attention, the o product, RMSNorm, gate/up, SiLU·mul, down. The results are bitwise those of the
 * loop; what goes is the loop's Python between the ~10 kernel calls of each layer (~1-2 ms a step).
 * Used only where every one of those kernels runs in C (linear_bf16.c's and decode_attention.c's
 * vector paths) and there is no tensor parallelism (its all-reduces are between the kernels). Where
 * the linear layers are oneDNN's (AMX CPUs), the loop calls `attention_block_bf16` instead, each
 * layer's RoPE, K/V write and attention.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_formats.h"
#include "side_prefetch.h"

/* At most this much of the next layer's K/V is prefetched during a layer's MLP: more would not stay in
 * the caches until its attention reads it (a prompt chunk's steps; a decode step of 32 sequences of ~150
 * tokens of SmolLM2 reads ~3.6 MiB a layer). */
#define SIDE_PREFETCH_MAX_BYTES (8 << 20)

void add_rms_norm_bf16(uint16_t *hidden, int64_t hidden_stride, const uint16_t *delta, int64_t delta_stride,
                       const uint16_t *weight, uint16_t *out, int64_t out_stride, int64_t rows, int dim, float eps);
void rope_bf16(uint16_t *x, int64_t x_stride, int64_t rows, int num_heads, int head_dim, const int64_t *positions,
               const uint16_t *cos_table, const uint16_t *sin_table);
void silu_mul_bf16(const uint16_t *gate_up, int64_t gate_up_stride, uint16_t *out, int64_t out_stride, int64_t rows,
                   int n);
void linear_bf16(const uint16_t *a, int64_t lda, const uint16_t *wp, const uint16_t *bias, uint16_t *c,
                 int64_t ldc, int rows, int n, int k);
void linear_bf16_side(const uint16_t *a, int64_t lda, const uint16_t *wp, const uint16_t *bias, uint16_t *c,
                      int64_t ldc, int rows, int n, int k, const side_prefetch *side);
int64_t linear_bf16_pairs(int rows, int n, int k);
void linear_amx(const uint16_t *a, int64_t lda, const uint16_t *wp, const uint16_t *bias, uint16_t *c, int64_t ldc,
                int rows, int n, int k);
int linear_gguf(const uint16_t *a, int64_t lda, const uint8_t *wp, int type, const uint16_t *bias, void *c,
                int64_t ldc, int rows, int n, int k, int f32_out);
int decode_attention_bf16(const uint16_t *q, int64_t q_row_stride, const int64_t *q_rows,
                          const void *cache, const int32_t *pages, int max_pages, const int32_t *kv_lens,
                          uint16_t *out, int64_t out_row_stride, int num_seqs, int num_qo_heads,
                          int num_kv_heads, int head_dim, int block_size, float scale, int kv_kind);
int decode_attention_bf16_rows(const uint16_t *q, int64_t q_row_stride, const int64_t *q_rows,
                               const void *cache, const int32_t *pages, int max_pages, const int32_t *kv_lens,
                               uint16_t *out, int64_t out_row_stride, int num_seqs, int num_qo_heads,
                               int num_kv_heads, int head_dim, int block_size, float scale, int kv_kind);

/* A layer's attention block, from its q/k/v product to attention's output: RoPE on q and k in place in
 * qkv_buf [rows, q + 2 kv], the new K/V rows written into the layer's paged HND cache at k_rows / v_rows
 * [rows * kv_heads] (cache rows of head_dim), then attention for the attn_rows rows of the attention
 * backend's C plan (q_rows, pages [attn_rows, max_pages], kv_lens: every row, or all but fresh prompts
 * that the caller runs through SDPA) into attn [rows, q]. One call instead of three for the per-layer
 * loop where the linear layers are not C (oneDNN on AMX): the same kernels, so the same bits. `tiles`: prompt
 * chunks through the attention kernel's 16-row tiles; 0: every row per row (the same bits, slower: for
 * comparisons). kv_kind: the cache's row format (kv_formats.h), K/V rows written as kernels/cache_ops.py writes them.
 * Returns 0, or decode_attention_bf16's error. */
int lora_add_bf16(const uint16_t *x, int64_t x_stride, uint16_t *y, int64_t y_stride, int rows, const int32_t *row_slot,
                  const int64_t *a_ptrs, const int64_t *bt_ptrs, const int32_t *ranks, int num_slots, int in, int out);
int lora_add_bf16_dp(const uint16_t *x, int64_t x_stride, uint16_t *y, int64_t y_stride, int rows,
                     const int32_t *row_slot, const int64_t *a_ptrs, const int64_t *bt_ptrs, const int32_t *ranks,
                     int num_slots, int in, int out);
int attention_block_bf16(uint16_t *qkv_buf, int rows, int num_heads, int num_kv_heads, int head_dim,
                         const int64_t *positions, const uint16_t *cos_table, const uint16_t *sin_table,
                         void *layer_cache, int block_size, const int64_t *k_rows, const int64_t *v_rows,
                         int attn_rows, const int64_t *q_rows, const int32_t *pages, int max_pages,
                         const int32_t *kv_lens, float scale, uint16_t *attn, int tiles, int kv_kind) {
    const int q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
    const int qkv_width = q_size + 2 * kv_size;
    rope_bf16(qkv_buf, qkv_width, rows, num_heads + num_kv_heads, head_dim, positions, cos_table, sin_table);
#pragma omp parallel for schedule(static) if ((int64_t)rows * num_kv_heads >= 256)
    for (int t = 0; t < rows; t++)
        for (int h = 0; h < num_kv_heads; h++) {
            const uint16_t *k = qkv_buf + (int64_t)t * qkv_width + q_size + h * head_dim;
            kv_write_row(kv_kind, k, layer_cache, k_rows[(int64_t)t * num_kv_heads + h], head_dim);
            kv_write_row(kv_kind, k + kv_size, layer_cache, v_rows[(int64_t)t * num_kv_heads + h], head_dim);
        }
    return (tiles ? decode_attention_bf16 : decode_attention_bf16_rows)(
        qkv_buf, qkv_width, q_rows, layer_cache, pages, max_pages, kv_lens, attn, q_size, attn_rows, num_heads,
        num_kv_heads, head_dim, block_size, scale, kv_kind);
}

#define KIND_PANELS 0     /* linear_bf16.c's panels */
#define KIND_AMX 1        /* linear_amx.c's tiles */
#define KIND_GGUF_BASE 100 /* + a ggml type: linear_gguf.c's tiles of that type */

/* The weights' kernel, as they were packed for (`kind`); the panels also prefetch `side` (NULL: nothing).
 * Returns 0, or linear_gguf's error. */
static inline int layer_linear(int kind, const uint16_t *a, int64_t lda, const uint16_t *wp, const uint16_t *bias,
                               uint16_t *c, int64_t ldc, int rows, int n, int k, const side_prefetch *side) {
    if (kind >= KIND_GGUF_BASE)
        return linear_gguf(a, lda, (const uint8_t *)wp, kind - KIND_GGUF_BASE, bias, c, ldc, rows, n, k, 0);
    if (kind == KIND_AMX)
        linear_amx(a, lda, wp, bias, c, ldc, rows, n, k);
    else
        linear_bf16_side(a, lda, wp, bias, c, ldc, rows, n, k, side);
    return 0;
}

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* LoRA (issue 41): after product `group` (0 q/k/v, 1 o, 2 gate/up, 3 down) of layer i, each row's adapter's
 * delta (lora.c), from lora_tables[(i * 4 + group) * 4 ..]: that product's per-slot A, Bt and rank arrays (0:
 * no adapter in any slot adapts it) and the weights' kind (0 float32: lora_add_bf16; 1 bfloat16:
 * lora_add_bf16_dp). row_slot NULL: no LoRA in this step. */
static inline int layer_lora(const int32_t *row_slot, const int64_t *lora_tables, int num_slots, int i, int group,
                             const uint16_t *x, int64_t ldx, uint16_t *y, int64_t ldy, int rows, int in, int out) {
    if (row_slot == NULL) return 0;
    const int64_t *t = lora_tables + ((int64_t)i * 4 + group) * 4;
    if (t[0] == 0) return 0;
    return (t[3] ? lora_add_bf16_dp : lora_add_bf16)(x, ldx, y, ldy, rows, row_slot, (const int64_t *)(intptr_t)t[0],
                                                     (const int64_t *)(intptr_t)t[1], (const int32_t *)(intptr_t)t[2],
                                                     num_slots, in, out);
}

static int compare_i32(const void *a, const void *b) {
    const int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* The distinct pages that the step's attention reads (each row's first ceil(kv_len / block_size)), sorted,
 * into a new array (the caller frees it); *count: how many. NULL (and 0) when there are none or malloc fails. */
static int32_t *step_pages(int rows, const int32_t *pages, int max_pages, const int32_t *kv_lens, int block_size,
                           int64_t *count) {
    int64_t total = 0;
    for (int r = 0; r < rows; r++) total += (kv_lens[r] + block_size - 1) / block_size;
    *count = 0;
    int32_t *out = total > 0 ? malloc(sizeof(int32_t) * (size_t)total) : NULL;
    if (!out) return NULL;
    int64_t n = 0;
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < (kv_lens[r] + block_size - 1) / block_size; j++) out[n++] = pages[(int64_t)r * max_pages + j];
    qsort(out, (size_t)n, sizeof(int32_t), compare_i32);
    int64_t u = 0;
    for (int64_t i = 0; i < n; i++)
        if (u == 0 || out[i] != out[u - 1]) out[u++] = out[i];
    *count = u;
    return out;
}

/* Per-layer weights and caches come as int64 arrays of addresses, num_layers entries each (qkv_bias: 0 for
 * none); linear weights packed by linear_bf16_pack (or linear_amx_pack: `amx`). hidden [rows,
 * hidden_size]: the embeddings in, the residual stream out, with the last block's output in `delta` not
 * yet added (as the loop leaves it).
 * Scratch: x [rows, hidden], qkv [rows, q + 2 kv], attn [rows, q], gate_up [rows, 2 inter], act [rows,
 * inter], delta and o_out [rows, hidden].
 * k_rows / v_rows [rows * kv_heads]: the cache rows (of a layer seen as [*, head_dim]) the new K/V go
 * to. q_rows, pages [rows, max_pages], kv_lens: attention's rows (every row of the step). kind: the kernel the
 * weights are packed for (KIND_*). tiles, kv_kind: as attention_block_bf16's. lora_row_slot, lora_tables,
 * lora_num_slots: the step's LoRA adapters (layer_lora; NULL: none). Returns 0, or decode_attention_bf16's,
 * linear_gguf's or lora_add_bf16's error. */
int llama_layers_bf16(uint16_t *hidden, int rows, int hidden_size, int num_heads, int num_kv_heads, int head_dim,
                      int intermediate, float eps, int num_layers, const int64_t *input_norm, const int64_t *qkv,
                      const int64_t *qkv_bias, const int64_t *o, const int64_t *post_norm, const int64_t *gate_up,
                      const int64_t *down, const int64_t *cache, int block_size, const int64_t *positions,
                      const uint16_t *cos_table, const uint16_t *sin_table, const int64_t *k_rows,
                      const int64_t *v_rows, const int64_t *q_rows, const int32_t *pages, int max_pages,
                      const int32_t *kv_lens, float scale, uint16_t *x, uint16_t *qkv_buf, uint16_t *attn,
                      uint16_t *gate_up_buf, uint16_t *act, uint16_t *o_out, uint16_t *delta, int kind, int tiles,
                      int kv_kind, const int32_t *lora_row_slot, const int64_t *lora_tables, int lora_num_slots) {
    const int q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
    const int qkv_width = q_size + 2 * kv_size;
    /* A layer's K/V pages are prefetched during the products before its attention, as late as their K pairs
     * allow (one line each, side_prefetch.h): its own q/k/v product takes the last lines, the down and then the
     * gate/up products of the layer before take the rest. */
    int64_t num_pages = 0;
    int32_t *used = kind != KIND_PANELS ? NULL : step_pages(rows, pages, max_pages, kv_lens, block_size, &num_pages);
    const int64_t page_bytes = (int64_t)2 * num_kv_heads * block_size * kv_row_bytes(kv_kind, head_dim);
    int64_t lines = num_pages * side_lines_per_page(page_bytes);
    const int64_t max_lines = SIDE_PREFETCH_MAX_BYTES / SIDE_LINE;
    lines = lines < max_lines ? lines : max_lines;
    const int64_t in_qkv = min64(lines, linear_bf16_pairs(rows, qkv_width, hidden_size));
    const int64_t in_down = min64(lines - in_qkv, linear_bf16_pairs(rows, hidden_size, intermediate));
    const int64_t in_gate_up = min64(lines - in_qkv - in_down, linear_bf16_pairs(rows, 2 * intermediate, hidden_size));
    for (int i = 0; i < num_layers; i++) {
        const char *this_layer = (const char *)cache[i], *next_layer = (const char *)cache[i + 1 < num_layers ? i + 1 : i];
        const int64_t next = used && i + 1 < num_layers;  /* 1: prefetch the next layer's pages here */
        const side_prefetch qkv_side = {this_layer, used, page_bytes, lines - in_qkv, used ? in_qkv : 0};
        const side_prefetch gate_up_side = {next_layer, used, page_bytes, 0, next * in_gate_up};
        const side_prefetch down_side = {next_layer, used, page_bytes, in_gate_up, next * in_down};
        add_rms_norm_bf16(hidden, hidden_size, i ? delta : NULL, hidden_size, (const uint16_t *)input_norm[i], x,
                          hidden_size, rows, hidden_size, eps);
        int rc = layer_linear(kind, x, hidden_size, (const uint16_t *)qkv[i], (const uint16_t *)qkv_bias[i], qkv_buf,
                              qkv_width, rows, qkv_width, hidden_size, &qkv_side);
        if (rc == 0)
            rc = layer_lora(lora_row_slot, lora_tables, lora_num_slots, i, 0, x, hidden_size, qkv_buf, qkv_width, rows,
                            hidden_size, qkv_width);
        if (rc == 0)
            rc = attention_block_bf16(qkv_buf, rows, num_heads, num_kv_heads, head_dim, positions, cos_table, sin_table,
                                      (void *)cache[i], block_size, k_rows, v_rows, rows, q_rows, pages, max_pages,
                                      kv_lens, scale, attn, tiles, kv_kind);
        if (rc == 0)
            rc = layer_linear(kind, attn, q_size, (const uint16_t *)o[i], NULL, o_out, hidden_size, rows, hidden_size,
                              q_size, NULL);
        if (rc == 0)
            rc = layer_lora(lora_row_slot, lora_tables, lora_num_slots, i, 1, attn, q_size, o_out, hidden_size, rows,
                            q_size, hidden_size);
        if (rc == 0) {
            add_rms_norm_bf16(hidden, hidden_size, o_out, hidden_size, (const uint16_t *)post_norm[i], x, hidden_size,
                              rows, hidden_size, eps);
            rc = layer_linear(kind, x, hidden_size, (const uint16_t *)gate_up[i], NULL, gate_up_buf, 2 * intermediate,
                              rows, 2 * intermediate, hidden_size, &gate_up_side);
            if (rc == 0)
                rc = layer_lora(lora_row_slot, lora_tables, lora_num_slots, i, 2, x, hidden_size, gate_up_buf,
                                2 * intermediate, rows, hidden_size, 2 * intermediate);
        }
        if (rc == 0) {
            silu_mul_bf16(gate_up_buf, 2 * intermediate, act, intermediate, rows, intermediate);
            rc = layer_linear(kind, act, intermediate, (const uint16_t *)down[i], NULL, delta, hidden_size, rows,
                              hidden_size, intermediate, &down_side);
            if (rc == 0)
                rc = layer_lora(lora_row_slot, lora_tables, lora_num_slots, i, 3, act, intermediate, delta, hidden_size,
                                rows, intermediate, hidden_size);
        }
        if (rc != 0) {
            free(used);
            return rc;
        }
    }
    free(used);
    return 0;
}
