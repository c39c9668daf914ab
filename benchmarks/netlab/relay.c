/* erdma-relay: the delay line of the eRDMA network lab.
 *
 * An L2 switch on AF_PACKET sockets, one per port (a veth end in the lab's switch namespace). Every frame
 * that crosses it gets a one-way delay (plus uniform jitter), may be dropped at random (loss) and may be
 * held back so that later frames overtake it (reordering). Rate limits are not done here: tbf qdiscs on the
 * veths do them in the kernel. MAC addresses are learned; unknown and broadcast destinations are flooded.
 *
 *   erdma-relay --delay-us D [--jitter-us J] [--loss-ppm L] [--reorder-ppm R --reorder-gap-us G]
 *               [--seed S] [--slots N] IFACE...
 *
 * A port named fd:N is the datagram socket the relay inherited as descriptor N instead of an interface's
 * AF_PACKET socket: what tests/sanitize/relay_frames.py feeds frames through (a socket pair per port).
 *
 * Prints one JSON line of counters on SIGTERM/SIGINT (and on SIGUSR1, without exiting).
 * Frames wait in a min-heap ordered by release time; without jitter or reordering that is a FIFO.
 * Single-threaded, blocking in ppoll() until a socket is readable or the next release is due: no busy-poll.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/if_packet.h>
#include <net/ethernet.h>
#include <net/if.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define MAX_PORTS 32
#define SLOT_BYTES 9216 /* jumbo frames fit */
#define BATCH 64
#define MAC_TABLE 256

typedef struct {
    uint64_t release_ns;
    uint64_t order; /* arrival order: ties release FIFO */
    uint32_t slot;
    uint16_t len;
    int16_t out; /* port index, or -1 to flood */
    int16_t in;
} item_t;

static struct {
    int fd[MAX_PORTS];
    int nports;
    uint8_t *slots;
    uint32_t *free_slots;
    uint32_t nfree, nslots;
    item_t *heap;
    uint32_t heap_len;
    uint64_t order;
    uint8_t macs[MAC_TABLE][6];
    int mac_port[MAC_TABLE];
    int nmacs;
    uint64_t rx, tx, lost, reordered, full, send_err;
    uint64_t delay_ns, jitter_ns, reorder_gap_ns;
    uint32_t loss_ppm, reorder_ppm;
    uint64_t rng;
} S;

static volatile sig_atomic_t stop_flag, report_flag;

static void on_signal(int sig) {
    if (sig == SIGUSR1)
        report_flag = 1;
    else
        stop_flag = 1;
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint64_t rng_next(void) { /* xorshift64* */
    S.rng ^= S.rng >> 12;
    S.rng ^= S.rng << 25;
    S.rng ^= S.rng >> 27;
    return S.rng * 2685821657736338717ull;
}

static uint32_t rng_ppm(void) { return (uint32_t)(rng_next() % 1000000u); }

static int item_less(const item_t *a, const item_t *b) {
    return a->release_ns < b->release_ns || (a->release_ns == b->release_ns && a->order < b->order);
}

static void heap_push(item_t it) {
    uint32_t i = S.heap_len++;
    S.heap[i] = it;
    while (i > 0) {
        uint32_t p = (i - 1) / 2;
        if (!item_less(&S.heap[i], &S.heap[p]))
            break;
        item_t t = S.heap[p];
        S.heap[p] = S.heap[i];
        S.heap[i] = t;
        i = p;
    }
}

static item_t heap_pop(void) {
    item_t top = S.heap[0];
    S.heap[0] = S.heap[--S.heap_len];
    uint32_t i = 0;
    for (;;) {
        uint32_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < S.heap_len && item_less(&S.heap[l], &S.heap[m]))
            m = l;
        if (r < S.heap_len && item_less(&S.heap[r], &S.heap[m]))
            m = r;
        if (m == i)
            break;
        item_t t = S.heap[m];
        S.heap[m] = S.heap[i];
        S.heap[i] = t;
        i = m;
    }
    return top;
}

static int mac_lookup(const uint8_t *mac) {
    for (int i = 0; i < S.nmacs; i++)
        if (memcmp(S.macs[i], mac, 6) == 0)
            return S.mac_port[i];
    return -1;
}

static void mac_learn(const uint8_t *mac, int port) {
    if (mac[0] & 1)
        return; /* multicast source: ignore */
    for (int i = 0; i < S.nmacs; i++)
        if (memcmp(S.macs[i], mac, 6) == 0) {
            S.mac_port[i] = port;
            return;
        }
    if (S.nmacs < MAC_TABLE) {
        memcpy(S.macs[S.nmacs], mac, 6);
        S.mac_port[S.nmacs++] = port;
    }
}

static void report(FILE *f) {
    fprintf(f,
            "{\"rx\": %llu, \"tx\": %llu, \"lost\": %llu, \"reordered\": %llu, \"queue_full\": %llu, "
            "\"send_errors\": %llu, \"queued\": %u}\n",
            (unsigned long long)S.rx, (unsigned long long)S.tx, (unsigned long long)S.lost,
            (unsigned long long)S.reordered, (unsigned long long)S.full, (unsigned long long)S.send_err,
            S.heap_len);
    fflush(f);
}

static int open_port(const char *ifname) {
    int fd = socket(AF_PACKET, SOCK_RAW | SOCK_NONBLOCK, htons(ETH_P_ALL));
    if (fd < 0) {
        perror("socket(AF_PACKET)");
        exit(2);
    }
    unsigned idx = if_nametoindex(ifname);
    if (!idx) {
        fprintf(stderr, "erdma-relay: no interface %s\n", ifname);
        exit(2);
    }
    struct sockaddr_ll sll = {.sll_family = AF_PACKET, .sll_protocol = htons(ETH_P_ALL), .sll_ifindex = (int)idx};
    if (bind(fd, (struct sockaddr *)&sll, sizeof sll) < 0) {
        perror("bind");
        exit(2);
    }
    /* only frames arriving on the port: our own transmissions must not come back as receptions */
    int one = 1;
    setsockopt(fd, SOL_PACKET, PACKET_IGNORE_OUTGOING, &one, sizeof one);
    int buf = 8 << 20;
    setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &buf, sizeof buf);
    setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, &buf, sizeof buf);
    struct packet_mreq mr = {.mr_ifindex = (int)idx, .mr_type = PACKET_MR_PROMISC};
    setsockopt(fd, SOL_PACKET, PACKET_ADD_MEMBERSHIP, &mr, sizeof mr);
    return fd;
}

static int inherited_port(const char *num) { /* fd:N: non-blocking, as an AF_PACKET port is */
    int fd = atoi(num);
    int flags = fcntl(fd, F_GETFL);
    if (fd < 0 || flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) {
        fprintf(stderr, "erdma-relay: fd:%s is not an open descriptor\n", num);
        exit(2);
    }
    return fd;
}

static void transmit(const item_t *it) {
    const uint8_t *frame = S.slots + (size_t)it->slot * SLOT_BYTES;
    for (int p = 0; p < S.nports; p++) {
        if (p == it->in || (it->out >= 0 && p != it->out))
            continue;
        if (send(S.fd[p], frame, it->len, 0) < 0)
            S.send_err++;
        else
            S.tx++;
    }
    S.free_slots[S.nfree++] = it->slot;
}

static void receive(int port) {
    struct mmsghdr msgs[BATCH];
    struct iovec iov[BATCH];
    uint32_t taken[BATCH];
    int n = 0;
    for (; n < BATCH && S.nfree > 0; n++) {
        taken[n] = S.free_slots[--S.nfree];
        iov[n].iov_base = S.slots + (size_t)taken[n] * SLOT_BYTES;
        iov[n].iov_len = SLOT_BYTES;
        memset(&msgs[n], 0, sizeof msgs[n]);
        msgs[n].msg_hdr.msg_iov = &iov[n];
        msgs[n].msg_hdr.msg_iovlen = 1;
    }
    if (n == 0) { /* every slot is queued: drain the socket, counting drops */
        uint8_t junk[SLOT_BYTES];
        while (recv(S.fd[port], junk, sizeof junk, MSG_DONTWAIT) > 0)
            S.full++;
        return;
    }
    int got = recvmmsg(S.fd[port], msgs, (unsigned)n, MSG_DONTWAIT, NULL);
    if (got < 0)
        got = 0;
    uint64_t t = now_ns();
    for (int i = got; i < n; i++)
        S.free_slots[S.nfree++] = taken[i];
    for (int i = 0; i < got; i++) {
        uint8_t *frame = iov[i].iov_base;
        unsigned len = msgs[i].msg_len;
        S.rx++;
        if (len < 14 || (msgs[i].msg_hdr.msg_flags & MSG_TRUNC)) {
            S.free_slots[S.nfree++] = taken[i];
            continue;
        }
        mac_learn(frame + 6, port);
        if (S.loss_ppm && rng_ppm() < S.loss_ppm) {
            S.lost++;
            S.free_slots[S.nfree++] = taken[i];
            continue;
        }
        uint64_t release = t + S.delay_ns;
        if (S.jitter_ns) { /* uniform in [-J, +J], never before arrival */
            int64_t j = (int64_t)(rng_next() % (2 * S.jitter_ns + 1)) - (int64_t)S.jitter_ns;
            release = (int64_t)release + j < (int64_t)t ? t : (uint64_t)((int64_t)release + j);
        }
        if (S.reorder_ppm && rng_ppm() < S.reorder_ppm) {
            release += S.reorder_gap_ns;
            S.reordered++;
        }
        item_t it = {.release_ns = release, .order = S.order++, .slot = taken[i], .len = (uint16_t)len,
                     .out = (int16_t)((frame[0] & 1) ? -1 : mac_lookup(frame)), .in = (int16_t)port};
        heap_push(it);
    }
}

static uint64_t arg_u64(const char *v) { return strtoull(v, NULL, 10); }

int main(int argc, char **argv) {
    S.nslots = 32768;
    S.rng = 0x9E3779B97F4A7C15ull;
    int i = 1;
    for (; i < argc && strncmp(argv[i], "--", 2) == 0; i += 2) {
        if (i + 1 >= argc) {
            fprintf(stderr, "erdma-relay: %s needs a value\n", argv[i]);
            return 2;
        }
        const char *k = argv[i] + 2, *v = argv[i + 1];
        if (!strcmp(k, "delay-us")) S.delay_ns = arg_u64(v) * 1000;
        else if (!strcmp(k, "jitter-us")) S.jitter_ns = arg_u64(v) * 1000;
        else if (!strcmp(k, "loss-ppm")) S.loss_ppm = (uint32_t)arg_u64(v);
        else if (!strcmp(k, "reorder-ppm")) S.reorder_ppm = (uint32_t)arg_u64(v);
        else if (!strcmp(k, "reorder-gap-us")) S.reorder_gap_ns = arg_u64(v) * 1000;
        else if (!strcmp(k, "seed")) S.rng = arg_u64(v) * 0x9E3779B97F4A7C15ull + 1;
        else if (!strcmp(k, "slots")) S.nslots = (uint32_t)arg_u64(v);
        else {
            fprintf(stderr, "erdma-relay: unknown option --%s (valid: --delay-us --jitter-us --loss-ppm "
                            "--reorder-ppm --reorder-gap-us --seed --slots)\n", k);
            return 2;
        }
    }
    if (argc - i < 2 || argc - i > MAX_PORTS) {
        fprintf(stderr, "erdma-relay: give 2..%d interfaces\n", MAX_PORTS);
        return 2;
    }
    for (; i < argc; i++)
        S.fd[S.nports++] = strncmp(argv[i], "fd:", 3) == 0 ? inherited_port(argv[i] + 3) : open_port(argv[i]);
    S.slots = malloc((size_t)S.nslots * SLOT_BYTES);
    S.free_slots = malloc(S.nslots * sizeof(uint32_t));
    S.heap = malloc(S.nslots * sizeof(item_t));
    if (!S.slots || !S.free_slots || !S.heap) {
        fprintf(stderr, "erdma-relay: out of memory for %u slots\n", S.nslots);
        return 2;
    }
    for (uint32_t s = 0; s < S.nslots; s++)
        S.free_slots[S.nfree++] = S.nslots - 1 - s;

    struct sigaction sa = {.sa_handler = on_signal};
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGUSR1, &sa, NULL);
    fprintf(stdout, "{\"ready\": true, \"ports\": %d}\n", S.nports);
    fflush(stdout);

    struct pollfd pfd[MAX_PORTS];
    for (int p = 0; p < S.nports; p++)
        pfd[p] = (struct pollfd){.fd = S.fd[p], .events = POLLIN};
    while (!stop_flag) {
        if (report_flag) {
            report_flag = 0;
            report(stdout);
        }
        uint64_t t = now_ns();
        while (S.heap_len && S.heap[0].release_ns <= t) {
            item_t it = heap_pop();
            transmit(&it);
        }
        struct timespec wait, *wp = NULL;
        if (S.heap_len) {
            uint64_t d = S.heap[0].release_ns - t;
            wait.tv_sec = (time_t)(d / 1000000000ull);
            wait.tv_nsec = (long)(d % 1000000000ull);
            wp = &wait;
        }
        int r = ppoll(pfd, (nfds_t)S.nports, wp, NULL);
        if (r < 0 && errno != EINTR) {
            perror("ppoll");
            return 1;
        }
        if (r > 0)
            for (int p = 0; p < S.nports; p++)
                if (pfd[p].revents & POLLIN)
                    receive(p);
    }
    report(stdout);
    return 0;
}
