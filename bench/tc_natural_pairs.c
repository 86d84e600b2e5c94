/* bench/tc_natural_pairs.c: a check for the design note "a tiled layout whose codes decode to natural (k, k + 1)
 * pairs" (docs/GPU-NOTES.md "Session 41"): tc_arrange's bit positions relabelled - code 2p to today's code p's
 * positions, code 2p + 1 to today's code p + 4's - make the unchanged 8-instruction tc_pairs (src/kernels/tiled_codes.h)
 * return the pairs (code 2p, code 2p + 1) instead of (code p, code p + 4). Also checks that the position table below
 * is tc_arrange's. Words: every 977th of the 2^32 (xor a random stream). No GPU.
 * Build and run: cc -O2 -Isrc -o /tmp/tc_natural_pairs bench/tc_natural_pairs.c && /tmp/tc_natural_pairs */
#include <stdint.h>
#include <stdio.h>

#include "kernels/tiled_codes.h"

/* pos[c][j]: where bit j of code c goes in tc_arrange (the table in tiled_codes.h's comment) */
static const int pos[8][4] = {{6, 7, 8, 15},     {3, 4, 5, 12},     {0, 1, 2, 9},      {30, 26, 27, 29},
                              {22, 23, 24, 31}, {19, 20, 21, 28}, {16, 17, 18, 25}, {14, 10, 11, 13}};

static uint32_t arrange(uint32_t w, const int (*P)[4]) {
    uint32_t a = 0;
    for (int c = 0; c < 8; c++)
        for (int j = 0; j < 4; j++) a |= ((w >> (4 * c + j)) & 1u) << P[c][j];
    return a;
}

int main(void) {
    int npos[8][4];
    for (int p = 0; p < 4; p++)
        for (int j = 0; j < 4; j++) {
            npos[2 * p][j] = pos[p][j];
            npos[2 * p + 1][j] = pos[p + 4][j];
        }
    uint64_t bad_table = 0, bad_pairs = 0, n = 0;
    uint32_t x = 12345;
    for (uint64_t i = 0; i < (1ull << 32); i += 977, n++) {
        const uint32_t w = (uint32_t)i ^ (x = x * 1664525u + 1013904223u);
        if (arrange(w, pos) != tc_arrange(w)) bad_table++;
        uint32_t p[4];
        tc_pairs(arrange(w, npos), p);
        for (int k = 0; k < 4; k++) { /* byte k of w: code 2k (low nibble) and 2k + 1 (high) */
            const uint32_t v = w >> (8 * k);
            const uint32_t ref = ((v & 7u) << 6) | ((v & 8u) << 12) | (((v >> 4) & 7u) << 22) | (((v >> 4) & 8u) << 28);
            if (p[k] != ref) bad_pairs++;
        }
    }
    printf("tc_natural_pairs: %llu words: position table vs tc_arrange %llu mismatches, natural pairs %llu mismatches\n",
           (unsigned long long)n, (unsigned long long)bad_table, (unsigned long long)bad_pairs);
    return bad_table || bad_pairs;
}
