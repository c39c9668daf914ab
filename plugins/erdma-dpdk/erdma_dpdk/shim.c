/* erdma-dpdk's data path: a reliable, ordered byte stream per peer over DPDK ports (memif, af_packet), with
 * the packet loop in C.
 *
 * A send hands a whole buffer (the core's frame header, then the payload); it is cut into packets of at most
 * ``frame_bytes`` (headers included), each with a packet sequence number (PSN) per direction. The receiver
 * keeps up to ``window`` packets per peer (a reorder window of mbufs), acknowledges cumulatively with a
 * 64-bit selective-acknowledgement bitmap and a window edge (credits: a sender never has more than the
 * receiver has room for, so memif's ring is never overrun and nothing is dropped for want of space), and the
 * reader copies bytes out of the mbufs straight into where they belong. Lost packets (af_packet drops at the
 * receiver without saying so) are sent again selectively: those the bitmap shows missing once a
 * round trip has passed, and every unacknowledged one at the retransmission timeout (RTT-based, doubling).
 * A peer is lost when its memif link goes down, or nothing is heard from it for ``peer_timeout_ms`` (a
 * keepalive goes out after ``keepalive_ms`` of silence).
 *
 * Threads: every call takes the endpoint's mutex; ``eds_progress`` releases it while it sleeps (back-off
 * from ``spin_us`` of yielding up to ``poll_max_us`` sleeps: never a busy loop on a shared core). cffi calls
 * run without the GIL.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <setjmp.h>
#include <sys/prctl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <rte_alarm.h>
#include <rte_bus_vdev.h>
#include <rte_eal.h>
#include <rte_errno.h>
#include <rte_ethdev.h>
#include <rte_mbuf.h>
#include <rte_mempool.h>

#include "shim.h"

#define ETHER_TYPE 0x88B5 /* IEEE local experimental */
#define MAGIC 0x4544      /* "ED" */
#define VERSION 1
#define T_DATA 1
#define T_ACK 2
#define T_PROBE 3 /* "answer with an ACK": a sender whose window is shut */
#define BURST 32
#define MAX_PORTS 64
#define MAX_LINKS 1024
#define COMPLETIONS 4096

struct __attribute__((packed)) wire {
    uint8_t dst_mac[6], src_mac[6];
    uint16_t ether_type; /* big-endian */
    uint16_t magic;
    uint8_t version, type;
    uint32_t job, nonce; /* the job, and the sender's endpoint (a rank's earlier life is not this one) */
    uint16_t src, dst;
    uint32_t psn;  /* DATA: this packet's number */
    uint32_t ack;  /* the next PSN the sender of this packet expects from its peer */
    uint64_t sack; /* bit i: PSN ack + 1 + i has arrived */
    uint32_t wnd;  /* the peer may send PSNs below this */
    uint16_t len;  /* payload bytes */
    uint16_t flags;
};
#define HDR ((int)sizeof(struct wire))

static __thread char err_buf[512];

static void fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err_buf, sizeof err_buf, fmt, ap);
    va_end(ap);
}

const char *eds_error(void) { return err_buf; }

/* memif frees a port's shared rings on DPDK's interrupt thread as soon as the peer's control socket closes (the
 * peer exited or was killed), with nothing that keeps a burst on another thread out of them: a burst that was
 * already inside faults. The shim looks at the link before every burst on such a port, and a burst that faults
 * anyway jumps back here (SIGSEGV/SIGBUS on this thread, inside a guarded burst only; any other fault goes to
 * the handler that was there before) and the port counts as gone: its peer is lost, as it is. */
static __thread sigjmp_buf *guard;
static struct sigaction old_segv, old_bus;

static void on_fault(int sig, siginfo_t *info, void *ctx) {
    if (guard)
        siglongjmp(*guard, 1);
    struct sigaction *old = sig == SIGBUS ? &old_bus : &old_segv;
    if (old->sa_flags & SA_SIGINFO && old->sa_sigaction) {
        old->sa_sigaction(sig, info, ctx);
        return;
    }
    if (old->sa_handler != SIG_IGN && old->sa_handler != SIG_DFL && old->sa_handler) {
        old->sa_handler(sig);
        return;
    }
    signal(sig, SIG_DFL);
    raise(sig);
}

static void install_fault_guard(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &old_segv);
    sigaction(SIGBUS, &sa, &old_bus);
}

static inline int before(uint32_t a, uint32_t b) { return (int32_t)(a - b) < 0; }

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

struct sdesc { /* one send: the frame header (copied), the caller's payload (read while it is cut up) and what
                 * follows the payload (copied: a sealed frame's tag) */
    struct sdesc *next;
    uint8_t head[128];
    int head_len;
    const uint8_t *data;
    uint64_t len;
    uint8_t tail[16];
    int tail_len;
    uint64_t token;
};

struct port {
    uint16_t id;
    int watch; /* memif: a link that goes down is a lost peer */
    int up;
    int gone; /* its peer disconnected: never polled again */
    struct rte_ether_addr mac;
    struct rte_mbuf *pending[2 * BURST]; /* handed to tx_burst, not taken yet */
    int npending;
    char vdev[64];
};

struct link {
    int peer, port, active, dead;
    uint8_t mac[6];
    uint32_t peer_nonce;
    /* sending */
    uint32_t snd_una, snd_nxt, peer_wnd;
    struct rte_mbuf **retx; /* window slots: packets sent and not acknowledged */
    uint64_t *tx_time;
    uint8_t *sacked, *again; /* again: sent more than once (no RTT sample) */
    struct sdesc *q_head, *q_tail;
    uint64_t q_off; /* bytes of the head send already cut (its header first) */
    uint64_t srtt_ns, rto_ns, last_ack_ns, probe_ns;
    uint32_t sack_high; /* the highest PSN the peer's bitmap said it has, while sack_any */
    int sack_any;
    /* receiving */
    uint32_t rcv_nxt, rcv_read, rcv_off, adv_wnd;
    struct rte_mbuf **rq;
    uint64_t readable, last_heard_ns, last_sent_ns;
    uint8_t *sink; /* where the next bytes go as they arrive (a large payload's place), or NULL */
    uint64_t sink_len, sink_filled;
    int need_ack;
    uint64_t sack;  /* the bitmap packets carry; computed again only after a packet was taken (sack_dirty) */
    int sack_dirty;
    /* counters */
    uint64_t retransmits, duplicates, sent_packets, received_packets, data_packets;
    char why[160];
};

struct eds_ep {
    pthread_mutex_t mu;
    char name[32];
    int rank;
    uint32_t job, nonce;
    int frame, mss, window, nb_desc;
    uint64_t rto_min, rto_max, keepalive, peer_timeout, spin, poll_max;
    struct rte_mempool *pool;
    struct port ports[MAX_PORTS];
    int nports;
    struct link *links; /* indexed by peer rank */
    int nlinks_max;
    int *active; /* peers with a link, in order added */
    int nactive;
    uint64_t done_tokens[COMPLETIONS];
    int done_status[COMPLETIONS];
    int ndone, ndone_head;
    uint64_t foreign, last_link_check;
    uint32_t loss_ppm, rng;
    volatile int wake; /* eds_wake: the thread in eds_progress returns at once (a waiter wants to drive) */
};

/* ---- EAL ---------------------------------------------------------------------------------------------- */
int eds_eal_init(int argc, char **argv) {
    cpu_set_t mask; /* EAL pins the calling thread to its main lcore: give the thread its cores back */
    int have = sched_getaffinity(0, sizeof mask, &mask) == 0;
    int r = rte_eal_init(argc, argv);
    if (have)
        sched_setaffinity(0, sizeof mask, &mask);
    if (r >= 0)
        install_fault_guard();
    if (r < 0) {
        fail("rte_eal_init failed: %s", rte_strerror(rte_errno));
        return -1;
    }
    return 0;
}

/* ---- endpoint ----------------------------------------------------------------------------------------- */
eds_ep *eds_ep_new(const char *name, int rank, unsigned int job, unsigned int nonce, int frame_bytes,
                   int buffer_bytes, int window, int nb_desc, int links, int ports, int rto_min_us, int rto_max_us,
                   int keepalive_ms, int peer_timeout_ms, int spin_us, int poll_max_us) {
    if (frame_bytes <= HDR || frame_bytes > 65000 || buffer_bytes < frame_bytes || buffer_bytes > 65000 || window < 4 || window > 65536 || links > MAX_LINKS ||
        ports > MAX_PORTS || links < 1) {
        fail("bad endpoint parameters (frame %d, window %d, links %d, ports %d)", frame_bytes, window, links,
             ports);
        return NULL;
    }
    eds_ep *ep = calloc(1, sizeof *ep);
    if (!ep) {
        fail("out of memory");
        return NULL;
    }
    pthread_mutex_init(&ep->mu, NULL);
    snprintf(ep->name, sizeof ep->name, "%s", name);
    ep->rank = rank;
    ep->job = job;
    ep->nonce = nonce;
    ep->frame = frame_bytes;
    ep->mss = frame_bytes - HDR;
    ep->window = window;
    ep->nb_desc = nb_desc;
    ep->rto_min = (uint64_t)rto_min_us * 1000;
    ep->rto_max = (uint64_t)rto_max_us * 1000;
    ep->keepalive = (uint64_t)keepalive_ms * 1000000;
    ep->peer_timeout = (uint64_t)peer_timeout_ms * 1000000;
    ep->spin = (uint64_t)spin_us * 1000;
    ep->poll_max = (uint64_t)poll_max_us * 1000;
    ep->rng = nonce | 1;
    ep->nlinks_max = links;
    ep->links = calloc((size_t)links, sizeof *ep->links);
    ep->active = calloc((size_t)links, sizeof *ep->active);
    /* every link's two windows (retransmission, reordering), every port's descriptors and bursts on their way */
    unsigned n = (unsigned)(links - 1) * 2u * (unsigned)window + (unsigned)ports * (2u * (unsigned)nb_desc + 4 * BURST)
                 + 2048;
    char pool[RTE_MEMPOOL_NAMESIZE];
    snprintf(pool, sizeof pool, "%s", name);
    ep->pool = rte_pktmbuf_pool_create(pool, n, 0, 0, (uint16_t)(RTE_PKTMBUF_HEADROOM + buffer_bytes), SOCKET_ID_ANY);
    if (!ep->links || !ep->active || !ep->pool) {
        fail("cannot make a pool of %u mbufs of %d bytes (%s): raise transport.dpdk.eal_memory_mb or lower "
             "window/frame_bytes", n, buffer_bytes, rte_strerror(rte_errno));
        eds_ep_free(ep);
        return NULL;
    }
    return ep;
}

int eds_add_port(eds_ep *ep, const char *vdev, const char *args, int watch_link) {
    if (ep->nports >= MAX_PORTS) {
        fail("too many ports");
        return -1;
    }
    if (rte_vdev_init(vdev, args) != 0) {
        fail("cannot create DPDK device %s (%s): %s", vdev, args, rte_strerror(rte_errno ? rte_errno : EINVAL));
        return -1;
    }
    struct port *p = &ep->ports[ep->nports];
    memset(p, 0, sizeof *p);
    snprintf(p->vdev, sizeof p->vdev, "%s", vdev);
    p->watch = watch_link;
    if (rte_eth_dev_get_port_by_name(vdev, &p->id) != 0) {
        fail("DPDK device %s made no port", vdev);
        rte_vdev_uninit(vdev);
        return -1;
    }
    ep->nports++; /* from here eds_ep_free closes it */
    struct rte_eth_conf conf;
    memset(&conf, 0, sizeof conf);
    uint16_t nrx = (uint16_t)ep->nb_desc, ntx = (uint16_t)ep->nb_desc;
    const char *step = "rte_eth_dev_configure";
    int r = rte_eth_dev_configure(p->id, 1, 1, &conf);
    if (r == 0 && (step = "rte_eth_dev_adjust_nb_rx_tx_desc"))
        r = rte_eth_dev_adjust_nb_rx_tx_desc(p->id, &nrx, &ntx);
    if (r == 0 && (step = "rte_eth_rx_queue_setup"))
        r = rte_eth_rx_queue_setup(p->id, 0, nrx, SOCKET_ID_ANY, NULL, ep->pool);
    if (r == 0 && (step = "rte_eth_tx_queue_setup"))
        r = rte_eth_tx_queue_setup(p->id, 0, ntx, SOCKET_ID_ANY, NULL);
    if (r == 0 && (step = "rte_eth_dev_start"))
        r = rte_eth_dev_start(p->id);
    if (r != 0) {
        fail("cannot start DPDK port %s (%s): %s failed: %s", vdev, args, step, rte_strerror(r < 0 ? -r : r));
        rte_eth_dev_close(p->id);
        rte_vdev_uninit(vdev);
        ep->nports--;
        return -1;
    }
    rte_eth_macaddr_get(p->id, &p->mac);
    return ep->nports - 1;
}

int eds_port_mac(eds_ep *ep, int port, unsigned char *mac) {
    if (port < 0 || port >= ep->nports)
        return -1;
    memcpy(mac, ep->ports[port].mac.addr_bytes, 6);
    return 0;
}

int eds_add_link(eds_ep *ep, int peer, int port, const unsigned char *mac, unsigned int nonce) {
    if (peer < 0 || peer >= ep->nlinks_max || port < 0 || port >= ep->nports || ep->links[peer].active) {
        fail("bad link (peer %d, port %d)", peer, port);
        return -1;
    }
    struct link *l = &ep->links[peer];
    size_t w = (size_t)ep->window;
    l->retx = calloc(w, sizeof *l->retx);
    l->rq = calloc(w, sizeof *l->rq);
    l->tx_time = calloc(w, sizeof *l->tx_time);
    l->sacked = calloc(w, 1);
    l->again = calloc(w, 1);
    if (!l->retx || !l->rq || !l->tx_time || !l->sacked || !l->again) {
        fail("out of memory");
        return -1;
    }
    l->peer = peer;
    l->port = port;
    memcpy(l->mac, mac, 6);
    l->peer_nonce = nonce;
    l->peer_wnd = (uint32_t)ep->window; /* the peer starts with its whole window free */
    l->adv_wnd = (uint32_t)ep->window;
    l->rto_ns = ep->rto_min * 4 > ep->rto_max ? ep->rto_max : ep->rto_min * 4;
    uint64_t t = now_ns();
    l->last_heard_ns = l->last_sent_ns = l->last_ack_ns = t;
    l->active = 1;
    ep->active[ep->nactive++] = peer;
    return 0;
}

int eds_links_up(eds_ep *ep) {
    pthread_mutex_lock(&ep->mu);
    int all = 1;
    for (int i = 0; i < ep->nports; i++) {
        struct rte_eth_link st;
        memset(&st, 0, sizeof st);
        rte_eth_link_get_nowait(ep->ports[i].id, &st);
        ep->ports[i].up = st.link_status == RTE_ETH_LINK_UP;
        all &= ep->ports[i].up;
    }
    pthread_mutex_unlock(&ep->mu);
    return all;
}

static int send_new(eds_ep *ep, struct link *l, uint64_t now);
static void flush_tx(eds_ep *ep);

/* ---- sending ------------------------------------------------------------------------------------------ */
int eds_send(eds_ep *ep, int peer, const unsigned char *head, int head_len, const unsigned char *data,
             unsigned long long len, const unsigned char *tail, int tail_len, unsigned long long token, int urgent) {
    if (peer < 0 || peer >= ep->nlinks_max || head_len < 0 || head_len > 128 || tail_len < 0 || tail_len > 16) {
        fail("bad send (peer %d, header %d bytes, tail %d bytes)", peer, head_len, tail_len);
        return -1;
    }
    struct sdesc *d = malloc(sizeof *d);
    if (!d) {
        fail("out of memory");
        return -1;
    }
    memcpy(d->head, head, (size_t)head_len);
    d->head_len = head_len;
    d->data = data;
    d->len = len;
    if (tail_len)
        memcpy(d->tail, tail, (size_t)tail_len);
    d->tail_len = tail_len;
    d->token = token;
    d->next = NULL;
    pthread_mutex_lock(&ep->mu);
    struct link *l = &ep->links[peer];
    if (!l->active || l->dead) {
        pthread_mutex_unlock(&ep->mu);
        free(d);
        fail("link to rank %d is %s", peer, l->active ? "dead" : "not set up");
        return -2;
    }
    if (!l->q_head) {
        l->q_head = l->q_tail = d;
    } else if (urgent && l->q_off == 0) { /* ahead of everything not started */
        d->next = l->q_head;
        l->q_head = d;
    } else if (urgent) { /* right after the one being cut */
        d->next = l->q_head->next;
        l->q_head->next = d;
        if (l->q_tail == l->q_head)
            l->q_tail = d;
    } else {
        l->q_tail->next = d;
        l->q_tail = d;
    }
    send_new(ep, l, now_ns()); /* the first packets leave now, on the caller's thread */
    flush_tx(ep);
    pthread_mutex_unlock(&ep->mu);
    return 0;
}

static void complete(eds_ep *ep, uint64_t token, int status) {
    /* the ring never overflows in practice (Python takes completions after every progress call); if it
     * would, the oldest stays and this waits for the next call */
    int at = (ep->ndone_head + ep->ndone) % COMPLETIONS;
    ep->done_tokens[at] = token;
    ep->done_status[at] = status;
    if (ep->ndone < COMPLETIONS)
        ep->ndone++;
}

static void fill_header(eds_ep *ep, struct link *l, struct rte_mbuf *m, uint8_t type) {
    struct wire *w = rte_pktmbuf_mtod(m, struct wire *);
    struct port *p = &ep->ports[l->port];
    memcpy(w->dst_mac, l->mac, 6);
    memcpy(w->src_mac, p->mac.addr_bytes, 6);
    w->ether_type = rte_cpu_to_be_16(ETHER_TYPE);
    w->magic = MAGIC;
    w->version = VERSION;
    w->type = type;
    w->job = ep->job;
    w->nonce = ep->nonce;
    w->src = (uint16_t)ep->rank;
    w->dst = (uint16_t)l->peer;
    w->ack = l->rcv_nxt;
    uint32_t w_edge = l->rcv_read + (uint32_t)ep->window;
    if (l->sack_dirty) { /* which packets after rcv_nxt are here changes only when one arrives */
        uint64_t sack = 0;
        for (uint32_t i = 0; i < 64; i++) {
            uint32_t psn = l->rcv_nxt + 1 + i;
            if (!before(psn, w_edge))
                break;
            if (l->rq[psn % (uint32_t)ep->window])
                sack |= 1ull << i;
        }
        l->sack = sack;
        l->sack_dirty = 0;
    }
    w->sack = l->sack;
    w->wnd = w_edge;
    l->adv_wnd = w_edge;
    l->need_ack = 0;
}

static void enqueue_tx(eds_ep *ep, struct link *l, struct rte_mbuf *m, uint64_t now) {
    struct port *p = &ep->ports[l->port];
    if (p->npending == 2 * BURST) { /* the device takes nothing: the packet waits for a retransmission */
        rte_pktmbuf_free(m);
        return;
    }
    p->pending[p->npending++] = m;
    l->last_sent_ns = now;
    l->sent_packets++;
}

static void port_gone(eds_ep *ep, int port, const char *why);

/* a watched port whose link went down since it was up is gone (its peer disconnected) */
static int usable(eds_ep *ep, int i) {
    struct port *p = &ep->ports[i];
    if (p->gone)
        return 0;
    if (!p->watch || !p->up)
        return 1;
    struct rte_eth_link st;
    memset(&st, 0, sizeof st);
    rte_eth_link_get_nowait(p->id, &st);
    if (st.link_status != RTE_ETH_LINK_UP) {
        port_gone(ep, i, "its memif link went down (the process closed it or exited)");
        return 0;
    }
    return 1;
}

/* a burst on port ``i`` (receive or send); on a memif port, guarded against its rings going away under it */
static uint16_t burst(eds_ep *ep, int i, int rx, struct rte_mbuf **pkts, uint16_t n) {
    struct port *p = &ep->ports[i];
    if (!p->watch)
        return rx ? rte_eth_rx_burst(p->id, 0, pkts, n) : rte_eth_tx_burst(p->id, 0, pkts, n);
    sigjmp_buf here;
    if (sigsetjmp(here, 0)) { /* no mask to save: the handler runs with SA_NODEFER */
        guard = NULL;
        port_gone(ep, i, rx ? "its memif rings went away under a receive (the process exited)"
                            : "its memif rings went away under a send (the process exited)");
        return 0;
    }
    guard = &here;
    uint16_t done = rx ? rte_eth_rx_burst(p->id, 0, pkts, n) : rte_eth_tx_burst(p->id, 0, pkts, n);
    guard = NULL;
    return done;
}

static void flush_tx(eds_ep *ep) {
    for (int i = 0; i < ep->nports; i++) {
        struct port *p = &ep->ports[i];
        if (!p->npending || !usable(ep, i))
            continue;
        uint16_t sent = burst(ep, i, 0, p->pending, (uint16_t)p->npending);
        if (sent < p->npending)
            memmove(p->pending, p->pending + sent, (size_t)(p->npending - sent) * sizeof *p->pending);
        p->npending -= sent;
    }
}

static void send_control(eds_ep *ep, struct link *l, uint8_t type, uint64_t now) {
    struct rte_mbuf *m = rte_pktmbuf_alloc(ep->pool);
    if (!m)
        return; /* the next round tries again */
    if (!rte_pktmbuf_append(m, (uint16_t)HDR)) {
        rte_pktmbuf_free(m);
        return;
    }
    fill_header(ep, l, m, type);
    struct wire *w = rte_pktmbuf_mtod(m, struct wire *);
    w->psn = l->snd_nxt;
    w->len = 0;
    w->flags = 0;
    enqueue_tx(ep, l, m, now);
}

static void transmit(eds_ep *ep, struct link *l, uint32_t psn, uint64_t now) {
    uint32_t slot = psn % (uint32_t)ep->window;
    struct rte_mbuf *m = l->retx[slot];
    fill_header(ep, l, m, T_DATA);
    rte_mbuf_refcnt_update(m, 1); /* the device frees its reference; ours stays until acknowledged */
    l->tx_time[slot] = now;
    enqueue_tx(ep, l, m, now);
}

/* cut queued sends into new packets while the peer's window and ours allow */
static int send_new(eds_ep *ep, struct link *l, uint64_t now) {
    int made = 0;
    while (l->q_head && before(l->snd_nxt, l->peer_wnd) && before(l->snd_nxt, l->snd_una + (uint32_t)ep->window)
           && ep->ports[l->port].npending < BURST) {
        struct rte_mbuf *m = rte_pktmbuf_alloc(ep->pool);
        if (!m)
            break;
        uint8_t *buf = (uint8_t *)rte_pktmbuf_append(m, (uint16_t)ep->frame);
        if (!buf) {
            rte_pktmbuf_free(m);
            break;
        }
        uint8_t *at = buf + HDR;
        int room = ep->mss;
        while (room > 0 && l->q_head) { /* small frames share a packet */
            struct sdesc *d = l->q_head;
            uint64_t body = (uint64_t)d->head_len + d->len, total = body + (uint64_t)d->tail_len;
            uint64_t take = total - l->q_off;
            if (take > (uint64_t)room)
                take = (uint64_t)room;
            uint64_t off = l->q_off, left = take;
            if (off < (uint64_t)d->head_len) {
                uint64_t h = (uint64_t)d->head_len - off;
                if (h > left)
                    h = left;
                memcpy(at, d->head + off, h);
                at += h;
                off += h;
                left -= h;
            }
            if (left && off < body) {
                uint64_t p = body - off;
                if (p > left)
                    p = left;
                memcpy(at, d->data + (off - (uint64_t)d->head_len), p);
                at += p;
                off += p;
                left -= p;
            }
            if (left) {
                memcpy(at, d->tail + (off - body), left);
                at += left;
            }
            room -= (int)take;
            l->q_off += take;
            if (l->q_off == total) {
                l->q_head = d->next;
                if (!l->q_head)
                    l->q_tail = NULL;
                l->q_off = 0;
                complete(ep, d->token, 0);
                free(d);
            }
        }
        uint16_t len = (uint16_t)(ep->mss - room);
        rte_pktmbuf_trim(m, (uint16_t)room);
        struct wire *w = rte_pktmbuf_mtod(m, struct wire *);
        w->psn = l->snd_nxt;
        w->len = len;
        w->flags = 0;
        uint32_t slot = l->snd_nxt % (uint32_t)ep->window;
        l->retx[slot] = m;
        l->sacked[slot] = 0;
        l->again[slot] = 0;
        l->snd_nxt++;
        l->data_packets++;
        transmit(ep, l, w->psn, now);
        made++;
    }
    return made;
}

static void retransmit(eds_ep *ep, struct link *l, uint64_t now) {
    if (l->snd_una == l->snd_nxt)
        return;
    uint32_t W = (uint32_t)ep->window;
    int timeout = now - l->tx_time[l->snd_una % W] >= l->rto_ns && now - l->last_ack_ns >= l->rto_ns;
    /* holes the peer's bitmap shows (packets after them arrived), or everything at the timeout */
    int holes = l->sack_any && before(l->snd_una, l->sack_high);
    if (!timeout && !holes)
        return;
    uint32_t last_sacked = holes ? l->sack_high : l->snd_una;
    uint64_t rtt = l->srtt_ns ? l->srtt_ns + l->srtt_ns / 2 : ep->rto_min;
    int sent = 0;
    for (uint32_t p = l->snd_una; before(p, l->snd_nxt) && ep->ports[l->port].npending < BURST; p++) {
        uint32_t s = p % W;
        if (l->sacked[s])
            continue;
        int hole = before(p, last_sacked) && now - l->tx_time[s] >= rtt;
        if (!timeout && !hole)
            continue;
        l->again[s] = 1;
        l->retransmits++;
        transmit(ep, l, p, now);
        sent++;
    }
    if (timeout && sent) {
        l->rto_ns = l->rto_ns * 2 > ep->rto_max ? ep->rto_max : l->rto_ns * 2;
        l->last_ack_ns = now; /* the next timeout is a whole (doubled) RTO away */
    }
}

static void on_ack(eds_ep *ep, struct link *l, const struct wire *w, uint64_t now) {
    uint32_t W = (uint32_t)ep->window;
    if (before(l->snd_una, w->ack) && !before(l->snd_nxt, w->ack)) {
        uint32_t last = w->ack - 1;
        if (!l->again[last % W] && l->retx[last % W]) { /* Karn: only packets sent once give samples */
            uint64_t sample = now - l->tx_time[last % W];
            l->srtt_ns = l->srtt_ns ? (7 * l->srtt_ns + sample) / 8 : sample;
        }
        while (before(l->snd_una, w->ack)) {
            uint32_t s = l->snd_una % W;
            rte_pktmbuf_free(l->retx[s]);
            l->retx[s] = NULL;
            l->snd_una++;
        }
        if (l->sack_any && before(l->sack_high, l->snd_una))
            l->sack_any = 0;
        uint64_t rto = 3 * l->srtt_ns;
        l->rto_ns = rto < ep->rto_min ? ep->rto_min : rto > ep->rto_max ? ep->rto_max : rto;
        l->last_ack_ns = now;
    }
    for (uint32_t i = 0; i < 64; i++)
        if (w->sack >> i & 1) {
            uint32_t p = w->ack + 1 + i;
            if (!before(p, l->snd_una) && before(p, l->snd_nxt)) {
                l->sacked[p % W] = 1;
                if (!l->sack_any || before(l->sack_high, p))
                    l->sack_high = p;
                l->sack_any = 1;
            }
        }
    if (before(l->peer_wnd, w->wnd))
        l->peer_wnd = w->wnd;
}

/* in-order bytes out of the reorder window into ``out``; frees packets read to their end */
static uint64_t copy_out(eds_ep *ep, struct link *l, uint8_t *out, uint64_t n) {
    uint32_t W = (uint32_t)ep->window;
    uint64_t done = 0;
    while (done < n && l->readable) {
        struct rte_mbuf *m = l->rq[l->rcv_read % W];
        uint32_t have = rte_pktmbuf_data_len(m) - l->rcv_off;
        uint32_t take = n - done < have ? (uint32_t)(n - done) : have;
        memcpy(out + done, rte_pktmbuf_mtod_offset(m, uint8_t *, l->rcv_off), take);
        done += take;
        l->readable -= take;
        l->rcv_off += take;
        if (l->rcv_off == rte_pktmbuf_data_len(m)) {
            rte_pktmbuf_free(m);
            l->rq[l->rcv_read % W] = NULL;
            l->rcv_read++;
            l->rcv_off = 0;
        }
    }
    /* a window that opened by a quarter is worth telling the peer about now */
    if (l->rcv_read + W - l->adv_wnd >= W / 4)
        l->need_ack = 1;
    return done;
}

static void on_data(eds_ep *ep, struct link *l, struct rte_mbuf *m, const struct wire *w) {
    uint32_t W = (uint32_t)ep->window;
    uint32_t psn = w->psn;
    l->need_ack = 1;
    if (before(psn, l->rcv_nxt) || !before(psn, l->rcv_read + W) || l->rq[psn % W]) {
        l->duplicates++;
        rte_pktmbuf_free(m);
        return;
    }
    rte_pktmbuf_adj(m, (uint16_t)HDR);
    rte_pktmbuf_trim(m, (uint16_t)(rte_pktmbuf_data_len(m) - w->len));
    l->rq[psn % W] = m;
    l->sack_dirty = 1;
    while (before(l->rcv_nxt, l->rcv_read + W) && l->rq[l->rcv_nxt % W]) {
        l->readable += rte_pktmbuf_data_len(l->rq[l->rcv_nxt % W]);
        l->rcv_nxt++;
    }
    if (l->sink && l->sink_filled < l->sink_len)
        l->sink_filled += copy_out(ep, l, l->sink + l->sink_filled, l->sink_len - l->sink_filled);
}

static void link_dead(eds_ep *ep, struct link *l, const char *why) {
    if (l->dead)
        return;
    l->dead = 1;
    snprintf(l->why, sizeof l->why, "%s", why);
    while (l->q_head) { /* sends not cut yet will never go: their callers hear of it */
        struct sdesc *d = l->q_head;
        l->q_head = d->next;
        complete(ep, d->token, 1);
        free(d);
    }
    l->q_tail = NULL;
    l->q_off = 0;
}

static void port_gone(eds_ep *ep, int port, const char *why) {
    ep->ports[port].gone = 1;
    for (int k = 0; k < ep->nactive; k++) {
        struct link *l = &ep->links[ep->active[k]];
        if (l->port == port)
            link_dead(ep, l, why);
    }
}

static int receive(eds_ep *ep, uint64_t now) {
    struct rte_mbuf *pkts[BURST];
    int got = 0;
    for (int i = 0; i < ep->nports; i++) {
        if (!usable(ep, i))
            continue;
        uint16_t n = burst(ep, i, 1, pkts, BURST);
        got += n;
        for (uint16_t k = 0; k < n; k++) {
            struct rte_mbuf *m = pkts[k];
            const struct wire *w = rte_pktmbuf_mtod(m, const struct wire *);
            struct link *l = NULL;
            if (m->nb_segs == 1 && rte_pktmbuf_data_len(m) >= HDR &&
                w->ether_type == rte_cpu_to_be_16(ETHER_TYPE) && w->magic == MAGIC && w->version == VERSION &&
                w->job == ep->job && w->dst == ep->rank && w->src < ep->nlinks_max &&
                rte_pktmbuf_data_len(m) >= HDR + w->len && w->len <= ep->mss)
                l = &ep->links[w->src];
            if (!l || !l->active || l->dead || w->nonce != l->peer_nonce || l->port != i) {
                ep->foreign++;
                rte_pktmbuf_free(m);
                continue;
            }
            if (ep->loss_ppm && w->type == T_DATA) { /* injected loss (transport.dpdk.inject_loss) */
                ep->rng = ep->rng * 1103515245u + 12345u;
                if ((ep->rng >> 8) % 1000000u < ep->loss_ppm) {
                    rte_pktmbuf_free(m);
                    continue;
                }
            }
            l->last_heard_ns = now;
            l->received_packets++;
            on_ack(ep, l, w, now);
            if (w->type == T_DATA)
                on_data(ep, l, m, w);
            else {
                if (w->type == T_PROBE)
                    l->need_ack = 1;
                rte_pktmbuf_free(m);
            }
        }
    }
    return got;
}

static void check_links(eds_ep *ep, uint64_t now) {
    if (now - ep->last_link_check < 2000000)
        return;
    ep->last_link_check = now;
    for (int i = 0; i < ep->nports; i++)
        usable(ep, i);
    for (int k = 0; k < ep->nactive; k++) {
        struct link *l = &ep->links[ep->active[k]];
        if (!l->dead && ep->peer_timeout && now - l->last_heard_ns > ep->peer_timeout) {
            char why[160];
            snprintf(why, sizeof why, "nothing heard from it for %.1f s (transport.dpdk.peer_timeout)",
                     (double)(now - l->last_heard_ns) / 1e9);
            link_dead(ep, l, why);
        }
    }
}

/* one round: receive, acknowledge, send; returns 1 when Python has something to do: sends finished, a sink
 * filled, a link failed, or bytes to read once the burst that brought them is over (or a good part of a window
 * waits: the sender may not send more until they are read) */
static int round_once(eds_ep *ep, uint64_t now, int *work) {
    *work = receive(ep, now) > 0;
    check_links(ep, now);
    int events = 0;
    uint64_t plenty = (uint64_t)ep->mss * (uint64_t)ep->window / 2;
    for (int k = 0; k < ep->nactive; k++) {
        struct link *l = &ep->links[ep->active[k]];
        if (l->dead) {
            events |= l->readable > 0 || l->sink_filled > 0;
            continue;
        }
        retransmit(ep, l, now);
        *work |= send_new(ep, l, now) > 0;
        if (l->q_head && !before(l->snd_nxt, l->peer_wnd) && now - l->probe_ns > l->rto_ns) {
            l->probe_ns = now; /* our window is shut: ask again, in case the update was lost */
            send_control(ep, l, T_PROBE, now);
        }
        if (l->need_ack || (ep->keepalive && now - l->last_sent_ns > ep->keepalive))
            send_control(ep, l, T_ACK, now);
        if ((l->sink && l->sink_filled == l->sink_len) || l->readable >= plenty)
            events = 1;
        if (l->readable)
            events |= 2;
    }
    flush_tx(ep);
    if (events & 2 && !(events & 1) && *work)
        events = 0; /* more is coming: read it all at once */
    return events || ep->ndone;
}

static __thread int slack_set;

int eds_progress(eds_ep *ep, long long timeout_us) {
    if (!slack_set) { /* the back-off's sleeps of a few microseconds would otherwise last 50 (the default slack) */
        prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
        slack_set = 1;
    }
    uint64_t start = now_ns(), pause = 0;
    uint64_t until = start + (uint64_t)(timeout_us < 0 ? 0 : timeout_us) * 1000;
    pthread_mutex_lock(&ep->mu);
    int dead_before = 0;
    for (int k = 0; k < ep->nactive; k++)
        dead_before += ep->links[ep->active[k]].dead;
    uint64_t idle_since = start;
    for (;;) {
        uint64_t now = now_ns();
        int work = 0;
        int events = round_once(ep, now, &work);
        int dead = 0;
        for (int k = 0; k < ep->nactive; k++)
            dead += ep->links[ep->active[k]].dead;
        if (events || dead != dead_before || now >= until || ep->wake) {
            ep->wake = 0;
            pthread_mutex_unlock(&ep->mu);
            return events || dead != dead_before;
        }
        if (work) {
            idle_since = now;
            pause = 0;
            continue;
        }
        pthread_mutex_unlock(&ep->mu);
        if (now - idle_since < ep->spin) {
            sched_yield();
        } else {
            pause = pause ? pause * 2 : 2000;
            if (pause > ep->poll_max)
                pause = ep->poll_max;
            if (now + pause > until)
                pause = until > now ? until - now : 0;
            struct timespec ts = {(time_t)(pause / 1000000000ull), (long)(pause % 1000000000ull)};
            nanosleep(&ts, NULL);
        }
        pthread_mutex_lock(&ep->mu);
    }
}

long long eds_read(eds_ep *ep, int peer, unsigned char *out, long long n, long long sink_min) {
    pthread_mutex_lock(&ep->mu);
    struct link *l = &ep->links[peer];
    long long done = (long long)copy_out(ep, l, out, (uint64_t)n);
    if (sink_min > 0 && n - done >= sink_min && !l->dead) { /* the rest lands there as it arrives */
        l->sink = out + done;
        l->sink_len = (uint64_t)(n - done);
        l->sink_filled = 0;
    }
    pthread_mutex_unlock(&ep->mu);
    return done;
}

long long eds_sink_take(eds_ep *ep, int peer) {
    pthread_mutex_lock(&ep->mu);
    struct link *l = &ep->links[peer];
    long long filled = (long long)l->sink_filled;
    l->sink = NULL;
    l->sink_len = l->sink_filled = 0;
    pthread_mutex_unlock(&ep->mu);
    return filled;
}

int eds_completions(eds_ep *ep, unsigned long long *tokens, int *status, int max) {
    pthread_mutex_lock(&ep->mu);
    int n = 0;
    while (n < max && ep->ndone) {
        tokens[n] = ep->done_tokens[ep->ndone_head];
        status[n] = ep->done_status[ep->ndone_head];
        ep->ndone_head = (ep->ndone_head + 1) % COMPLETIONS;
        ep->ndone--;
        n++;
    }
    pthread_mutex_unlock(&ep->mu);
    return n;
}

int eds_drop_queued(eds_ep *ep) {
    pthread_mutex_lock(&ep->mu);
    int n = 0;
    for (int k = 0; k < ep->nactive; k++) {
        struct link *l = &ep->links[ep->active[k]];
        struct sdesc **at = l->q_off ? &l->q_head->next : &l->q_head;
        while (*at) {
            struct sdesc *d = *at;
            *at = d->next;
            complete(ep, d->token, 1);
            free(d);
            n++;
        }
        l->q_tail = l->q_head;
    }
    pthread_mutex_unlock(&ep->mu);
    return n;
}

int eds_link_info_get(eds_ep *ep, int peer, eds_link_info *info) {
    if (peer < 0 || peer >= ep->nlinks_max)
        return -1;
    pthread_mutex_lock(&ep->mu);
    struct link *l = &ep->links[peer];
    info->readable = l->readable;
    info->retransmits = l->retransmits;
    info->duplicates = l->duplicates;
    info->foreign = ep->foreign;
    info->sent_packets = l->sent_packets;
    info->received_packets = l->received_packets;
    info->data_packets = l->data_packets;
    info->dead = l->dead;
    info->pending = l->q_head != NULL || l->snd_una != l->snd_nxt;
    if (l->dead)
        snprintf(info->why, sizeof info->why, "%s", l->why);
    else
        info->why[0] = 0;
    pthread_mutex_unlock(&ep->mu);
    return 0;
}

void eds_wake(eds_ep *ep) { ep->wake = 1; }

void eds_set_loss(eds_ep *ep, unsigned int per_million) { ep->loss_ppm = per_million; }

/* Ports are stopped, closed and removed on DPDK's interrupt thread (an alarm), where memif handles its control
 * sockets: a peer that disconnects at the same moment is handled before or after, never during. */
struct closer {
    eds_ep *ep;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int done;
};

static void close_ports(eds_ep *ep) {
    for (int i = 0; i < ep->nports; i++) {
        struct port *p = &ep->ports[i];
        rte_eth_dev_stop(p->id);
        rte_eth_dev_close(p->id);
        rte_vdev_uninit(p->vdev);
    }
}

static void close_ports_alarm(void *arg) {
    struct closer *c = arg;
    close_ports(c->ep);
    pthread_mutex_lock(&c->mu);
    c->done = 1;
    pthread_cond_signal(&c->cv);
    pthread_mutex_unlock(&c->mu);
}

void eds_ep_free(eds_ep *ep) {
    if (!ep)
        return;
    for (int i = 0; i < ep->nports; i++) {
        struct port *p = &ep->ports[i];
        for (int k = 0; k < p->npending; k++)
            rte_pktmbuf_free(p->pending[k]);
        p->npending = 0;
    }
    if (ep->nports) {
        struct closer c = {.ep = ep, .done = 0};
        pthread_mutex_init(&c.mu, NULL);
        pthread_cond_init(&c.cv, NULL);
        if (rte_eal_alarm_set(1, close_ports_alarm, &c) == 0) {
            pthread_mutex_lock(&c.mu);
            while (!c.done)
                pthread_cond_wait(&c.cv, &c.mu);
            pthread_mutex_unlock(&c.mu);
        } else {
            close_ports(ep);
        }
        pthread_cond_destroy(&c.cv);
        pthread_mutex_destroy(&c.mu);
    }
    if (ep->links) {
        for (int k = 0; k < ep->nlinks_max; k++) {
            struct link *l = &ep->links[k];
            for (int s = 0; l->retx && l->rq && s < ep->window; s++) {
                if (l->retx[s])
                    rte_pktmbuf_free(l->retx[s]);
                if (l->rq[s])
                    rte_pktmbuf_free(l->rq[s]);
            }
            while (l->q_head) {
                struct sdesc *d = l->q_head;
                l->q_head = d->next;
                free(d);
            }
            free(l->retx);
            free(l->rq);
            free(l->tx_time);
            free(l->sacked);
            free(l->again);
        }
    }
    rte_mempool_free(ep->pool);
    free(ep->links);
    free(ep->active);
    pthread_mutex_destroy(&ep->mu);
    free(ep);
}
