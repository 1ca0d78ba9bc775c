/*
 * vblk-frag: fragment the guest's physical memory, so that the buffers that programs
 * allocate afterwards are made of physically scattered 4 KiB pages, and every O_DIRECT
 * request built on them carries as many segments as the block layer allows.
 *
 *   vblk-frag MIB        take MIB MiB, give back every other physical page, hold the
 *                        rest (locked) until killed; prints one line when ready
 *
 * The page allocator serves order-0 requests from its smallest free blocks first, so the
 * isolated pages given back are what later allocations get. The held pages are locked
 * (mlock), and the caller sets vm.compact_unevictable_allowed=0, so that compaction does
 * not move them and undo the fragmentation. Pages are chosen by physical frame number
 * (from /proc/self/pagemap; root only), so that no two pages given back are neighbours;
 * without frame numbers, by virtual address.
 *
 * Under TCG every page fault and every system call is slow: the memory is populated in
 * one call (MADV_POPULATE_WRITE) and pages are given back with MADV_DONTNEED, which,
 * unlike munmap, does not split the mapping (one VMA, not one per page).
 *
 * Built at test time by the vblk test suite (`cc -static -O2`), see support/layer.rs.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#define PAGE 4096UL

int main(int argc, char **argv)
{
    if (argc != 2 || atol(argv[1]) <= 0) {
        fprintf(stderr, "usage: vblk-frag MIB\n");
        return 2;
    }
    size_t len = (size_t)atol(argv[1]) << 20, pages = len / PAGE;
    char *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        perror("vblk-frag: mmap");
        return 1;
    }
    if (madvise(p, len, MADV_NOHUGEPAGE) != 0)
        perror("vblk-frag: madvise(MADV_NOHUGEPAGE)");
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
    if (madvise(p, len, MADV_POPULATE_WRITE) != 0) {
        /* Before Linux 5.14: touch every page. */
        for (size_t i = 0; i < pages; i++)
            p[i * PAGE] = 1;
    }

    /* Physical frame numbers: bits 0-54 of each 8-byte pagemap entry, bit 63 = present. */
    uint64_t *pfn = calloc(pages, sizeof *pfn);
    int fd = open("/proc/self/pagemap", O_RDONLY);
    int physical = 0;
    if (pfn && fd >= 0) {
        off_t at = (off_t)((uintptr_t)p / PAGE * sizeof(uint64_t));
        ssize_t want = (ssize_t)(pages * sizeof(uint64_t));
        if (pread(fd, pfn, (size_t)want, at) == want) {
            physical = 1;
            for (size_t i = 0; i < pages; i++) {
                if (!(pfn[i] >> 63) || (pfn[i] & ((1ULL << 55) - 1)) == 0) {
                    physical = 0;
                    break;
                }
            }
        }
    }
    if (fd >= 0)
        close(fd);

    size_t freed = 0, held = 0;
    for (size_t i = 0; i < pages; i++) {
        uint64_t frame = pfn ? pfn[i] & ((1ULL << 55) - 1) : 0;
        int give_back = physical ? (frame & 1) : (i & 1);
        if (give_back) {
            if (madvise(p + i * PAGE, PAGE, MADV_DONTNEED) != 0) {
                perror("vblk-frag: madvise(MADV_DONTNEED)");
                return 1;
            }
            freed++;
        } else {
            held++;
        }
    }
    /* Locked pages stay where they are (with vm.compact_unevictable_allowed=0);
     * MCL_ONFAULT locks the pages present without faulting the given-back ones in. */
#ifndef MCL_ONFAULT
#define MCL_ONFAULT 4
#endif
    if (mlockall(MCL_CURRENT | MCL_ONFAULT) != 0) {
        perror("vblk-frag: mlockall");
        return 1;
    }
    free(pfn);
    printf("VBLK-FRAG ready: %zu MiB held, %zu MiB given back in single pages (by %s address)\n",
           held * PAGE >> 20, freed * PAGE >> 20, physical ? "physical" : "virtual");
    fflush(stdout);
    for (;;)
        pause();
}
