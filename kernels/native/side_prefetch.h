/* Cache lines that a compute-bound kernel prefetches on the side, for a memory-bound one that runs next.
 *
 * A decode step's attention reads every running sequence's K/V pages of a layer (megabytes, scattered
 * pages), and on the CPU it spends about as long waiting for them as computing: its own prefetches run
 * only one item ahead. The matrix products of the layer before (gate/up, down) are compute-bound and
 * leave the memory bus half idle. So llama_layers.c hands them the next layer's pages, and linear_bf16.c's
 * tiles issue one prefetch of those per K pair: the pages are in L2/L3 when the attention starts. The
 * lines are split evenly over the product's tiles, whichever thread runs them; a tile with more lines
 * than K pairs drops the rest. A prefetch never faults and changes no result.
 */
#ifndef HETERO_SIDE_PREFETCH_H
#define HETERO_SIDE_PREFETCH_H

#include <stdint.h>

#define SIDE_LINE 64

/* Lines [first, first + count) of the pages, in order: page pages[i] spans page_bytes at
 * base + pages[i] * page_bytes. */
typedef struct {
    const char *base;
    const int32_t *pages;
    int64_t page_bytes;
    int64_t first, count;
} side_prefetch;

/* One tile's share of a side_prefetch: the next line's address and how many are left. */
typedef struct {
    const char *next;
    const char *base;
    const int32_t *page;  /* the page `next` is in */
    int64_t page_bytes;
    int64_t left;
    int line, lines_per_page;
} side_cursor;

static inline int side_lines_per_page(int64_t page_bytes) {
    return (int)((page_bytes + SIDE_LINE - 1) / SIDE_LINE);
}

/* Tile t of `tiles`: its even share of the lines (none when s is NULL). */
static inline side_cursor side_cursor_at(const side_prefetch *s, int64_t t, int64_t tiles) {
    side_cursor c = {0};
    if (!s || s->count <= 0 || tiles <= 0) return c;
    const int64_t j0 = s->first + s->count * t / tiles, j1 = s->first + s->count * (t + 1) / tiles;
    c.left = j1 - j0;
    if (c.left <= 0) return c;
    c.lines_per_page = side_lines_per_page(s->page_bytes);
    c.base = s->base;
    c.page_bytes = s->page_bytes;
    c.page = s->pages + j0 / c.lines_per_page;
    c.line = (int)(j0 % c.lines_per_page);
    c.next = c.base + (int64_t)*c.page * c.page_bytes + (int64_t)c.line * SIDE_LINE;
    return c;
}

/* Prefetch the cursor's next line toward L2, if it has one left. */
static inline void side_cursor_next(side_cursor *c) {
    if (c->left <= 0) return;
    __builtin_prefetch(c->next, 0, 1);
    if (--c->left == 0) return;
    if (++c->line == c->lines_per_page) {
        c->line = 0;
        c->page++;
        c->next = c->base + (int64_t)*c->page * c->page_bytes;
    } else {
        c->next += SIDE_LINE;
    }
}

#endif
