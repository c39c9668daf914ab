/* A collective's steps in C, over queue pairs of their own (native.py sets them up; the transport runs a whole
   collective through here when it has no reduction or one reduce.c computes: ``VerbsTransport.run_program``).

   Per peer: a ring of ``slots`` slots of ``slot_bytes`` in each direction. A send is cut into pieces of at
   most ``slot_bytes``; each is copied into a registered send buffer and written (RDMA WRITE with immediate)
   into the peer's next free slot. The receiver copies each piece out of its ring in order and returns slots
   with a credit (SEND with immediate: slots consumed so far, mod 2^32). A sender never writes into a slot the
   receiver has not freed. The immediate carries the collective's tag (its sequence number and identity, 8
   bits) and the piece's length (24 bits): a piece of another collective, or of another length than the
   receive expects, fails the run (the ranks called different collectives).

   A run walks the steps in order. In a step, copies go first; then every send and receive moves as far as it
   can (sends as credits and the send queue allow, receives as pieces land, each after the earlier receives
   from its peer), until all are done. A reducing receive combines each piece into its target straight from
   the ring (``ev_reduce``), after the step's earlier reducing receives; a send of the same step whose bytes it
   combines into is copied aside when the step starts (``stage_sends``). ``ev_steps_run`` returns after ``budget`` seconds with 1 so that the
   caller can look at the rest of the world (an abort, a deadline) and call again with ``resume``. After a
   failure the queue pairs' state is unknown: the caller stops using them. When idle, the run polls (yielding
   the core) for ``spin`` seconds, then sleeps on the device's completion channel until a completion. */
#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <infiniband/verbs.h>

#include "ibv.h"

#include "ibv_types.h"

#define RECV_BIT (1ULL << 62)
#define CREDIT_BIT (1ULL << 61)
#define REPOST 8

typedef struct {
    struct ibv_qp *qp;
    unsigned long long remote, ring;   /* the peer's ring (its address), ours */
    unsigned int rkey;
    unsigned char *bounce;             /* slots pieces to this peer are copied into */
    unsigned int bounce_lkey, ctrl_lkey;
    unsigned long long sent, freed;    /* pieces written; slots the peer freed (its credits, mod 2^32) */
    unsigned long long arrived, used, reported;  /* pieces landed; consumed; slots reported freed */
    unsigned int *lens;                /* the immediate of each landed piece, by slot */
    int outstanding;                   /* sends not completed */
    int unposted;                      /* receives used and not posted again */
    int joined;
} peer_t;

typedef struct {
    unsigned long long off;   /* bytes posted (a send) or copied out (a receive) */
    int done;
    const unsigned char *from;  /* a send's own copy of its bytes (a receive of its step reduces into them) */
} cursor_t;

struct ev_steps {
    struct ibv_cq *cq;
    struct ibv_comp_channel *channel;  /* the device's (NULL: an idle run polls, yielding the core) */
    int n, slots, depth;
    unsigned int slot_bytes;
    double spin;
    peer_t *peers;
    unsigned long long ctrl_addr;
    cursor_t *cursors;  /* one per message of a run, grown to the longest */
    int ccap;
    int at, end, left;  /* the current step: its messages [at, end), those not done */
    void *const *bases;  /* the run's buffers: a message's address is bases[buf] + at */
    unsigned char *stage;  /* the current step's sends' copies (``cursor_t.from``), grown to the largest */
    size_t stage_cap;
    const ev_msg *msgs;               /* the run's messages */
    int bad_peer;
    char err[240];
};

static int fail(ev_steps *s, int code, int peer, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static int fail(ev_steps *s, int code, int peer, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(s->err, sizeof s->err, fmt, ap);
    va_end(ap);
    s->bad_peer = peer;
    return -code;
}

const char *ev_steps_error(ev_steps *s) { return s->err; }
int ev_steps_bad_peer(ev_steps *s) { return s->bad_peer; }

int ev_steps_waiting(ev_steps *s, int *kind) {
    for (int k = s->at; k < s->end && s->msgs; k++)
        if (!s->cursors[k].done) {
            *kind = s->msgs[k].kind;
            return s->msgs[k].peer;
        }
    return -1;
}

static int post_recvs(ev_steps *s, peer_t *p, int peer, int count) {
    struct ibv_sge sge = {.addr = s->ctrl_addr, .length = 1, .lkey = p->ctrl_lkey};
    for (int i = 0; i < count; i++) {
        struct ibv_recv_wr wr = {.wr_id = RECV_BIT | (unsigned)peer, .sg_list = &sge, .num_sge = 1}, *bad;
        int rc = ibv_post_recv(p->qp, &wr, &bad);
        if (rc)
            return fail(s, rc, peer, "rank %d: ibv_post_recv: %s", peer, strerror(rc));
    }
    return 0;
}

ev_steps *ev_steps_new(ev_dev *dev, int n, int slots, unsigned int slot_bytes, unsigned long long ctrl_addr,
                       double spin) {
    ev_steps *s = calloc(1, sizeof *s);
    if (!s)
        return NULL;
    s->cq = dev->cq;
    s->channel = dev->channel;
    s->n = n;
    s->slots = slots;
    s->slot_bytes = slot_bytes;
    s->depth = slots + 8;
    s->ctrl_addr = ctrl_addr;
    s->spin = spin;
    s->bad_peer = -1;
    s->peers = calloc((size_t)n, sizeof *s->peers);
    if (!s->peers) {
        free(s);
        return NULL;
    }
    return s;
}

int ev_steps_peer(ev_steps *s, int peer, ev_qp *qp, unsigned long long remote, unsigned int rkey,
                  unsigned long long ring, unsigned long long bounce, unsigned int bounce_lkey, unsigned int ctrl_lkey) {
    if (peer < 0 || peer >= s->n)
        return fail(s, EINVAL, peer, "rank %d is not in a world of %d", peer, s->n);
    peer_t *p = &s->peers[peer];
    p->qp = qp->qp;
    p->remote = remote;
    p->rkey = rkey;
    p->ring = ring;
    p->bounce = (unsigned char *)(uintptr_t)bounce;
    p->bounce_lkey = bounce_lkey;
    p->ctrl_lkey = ctrl_lkey;
    p->lens = calloc((size_t)s->slots, sizeof *p->lens);
    if (!p->lens)
        return fail(s, ENOMEM, peer, "out of memory");
    p->joined = 1;
    return post_recvs(s, p, peer, 2 * s->depth);
}

void ev_steps_free(ev_steps *s) {
    if (!s)
        return;
    for (int i = 0; i < s->n; i++)
        free(s->peers[i].lens);
    free(s->peers);
    free(s->cursors);
    free(s->stage);
    free(s);
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* Take the completions there are: landed pieces, credits, finished sends. */
static int progress(ev_steps *s) {
    struct ibv_wc wc[32];
    int n = ibv_poll_cq(s->cq, 32, wc);
    if (n < 0)
        return fail(s, EIO, -1, "ibv_poll_cq failed");
    for (int i = 0; i < n; i++) {
        int peer = (int)(wc[i].wr_id & 0xffff);
        if (peer >= s->n || !s->peers[peer].joined)
            continue;
        peer_t *p = &s->peers[peer];
        if (wc[i].status != IBV_WC_SUCCESS)
            return fail(s, EPIPE, peer, "a %s to rank %d completed with %s",
                        wc[i].wr_id & RECV_BIT ? "receive" : "write", peer, ibv_wc_status_str(wc[i].status));
        if (!(wc[i].wr_id & RECV_BIT)) {
            p->outstanding--;
            continue;
        }
        p->unposted++;
        if (wc[i].opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
            if (p->arrived - p->used >= (unsigned)s->slots)
                return fail(s, EPROTO, peer, "rank %d wrote into a slot this rank had not freed", peer);
            p->lens[p->arrived % (unsigned)s->slots] = wc[i].imm_data;
            p->arrived++;
        } else {
            p->freed = wc[i].imm_data;
        }
        if (p->unposted >= REPOST) {
            int rc = post_recvs(s, p, peer, p->unposted);
            if (rc)
                return rc;
            p->unposted = 0;
        }
    }
    return n;
}

/* A credit for the slots consumed so far, when the send queue has room (else it is tried again later). */
static int credit(ev_steps *s, peer_t *p, int peer) {
    if (p->outstanding >= s->depth - 1)
        return 0;
    struct ibv_sge sge = {.addr = s->ctrl_addr, .length = 1, .lkey = p->ctrl_lkey};
    struct ibv_send_wr wr = {.wr_id = CREDIT_BIT | (unsigned)peer, .sg_list = &sge, .num_sge = 1,
                             .opcode = IBV_WR_SEND_WITH_IMM, .send_flags = IBV_SEND_SIGNALED,
                             .imm_data = (uint32_t)p->used}, *bad;
    int rc = ibv_post_send(p->qp, &wr, &bad);
    if (rc)
        return fail(s, rc, peer, "rank %d: posting a credit: %s", peer, strerror(rc));
    p->outstanding++;
    p->reported = p->used;
    return 0;
}

/* Post the pieces of a send that the peer's free slots and our send queue allow; 1 when it moved. */
static int send_some(ev_steps *s, const ev_msg *m, cursor_t *c, unsigned int tag) {
    int peer = m->peer, moved = 0;
    peer_t *p = &s->peers[peer];
    const unsigned char *src = c->from ? c->from : (const unsigned char *)(uintptr_t)((uintptr_t)s->bases[m->buf] + m->at);
    while (!c->done) {
        if ((uint32_t)((uint32_t)p->sent - (uint32_t)p->freed) >= (uint32_t)s->slots || p->outstanding >= s->depth - 1)
            return moved;
        unsigned long long left = m->len - c->off;
        unsigned int piece = (unsigned int)(left < s->slot_bytes ? left : s->slot_bytes);
        unsigned int slot = (unsigned int)(p->sent % (unsigned)s->slots);
        unsigned char *b = p->bounce + (size_t)slot * s->slot_bytes;  /* free: the peer freed the slot, so this
                                                                           buffer's write to it has landed */
        memcpy(b, src + c->off, piece);
        struct ibv_sge sge = {.addr = (uintptr_t)b, .length = piece, .lkey = p->bounce_lkey};
        struct ibv_send_wr wr = {.wr_id = (unsigned)peer, .sg_list = &sge, .num_sge = piece ? 1 : 0,
                                 .opcode = IBV_WR_RDMA_WRITE_WITH_IMM, .send_flags = IBV_SEND_SIGNALED,
                                 .imm_data = (tag << 24) | piece,
                                 .wr.rdma = {.remote_addr = p->remote + (unsigned long long)slot * s->slot_bytes,
                                             .rkey = p->rkey}}, *bad;
        int rc = ibv_post_send(p->qp, &wr, &bad);
        if (rc)
            return fail(s, rc, peer, "rank %d: posting a write: %s", peer, strerror(rc));
        p->outstanding++;
        p->sent++;
        c->off += piece;
        c->done = c->off >= m->len;
        moved = 1;
    }
    return moved;
}

/* Copy out the pieces of a receive that have landed, in order, returning slots; 1 when it moved. */
static int recv_some(ev_steps *s, const ev_msg *m, cursor_t *c, unsigned int tag) {
    int peer = m->peer, moved = 0;
    peer_t *p = &s->peers[peer];
    unsigned char *dst = (unsigned char *)(uintptr_t)((uintptr_t)s->bases[m->buf] + m->at);
    while (!c->done && p->arrived != p->used) {
        unsigned int slot = (unsigned int)(p->used % (unsigned)s->slots);
        unsigned int imm = p->lens[slot], piece = imm & 0xffffff;
        unsigned long long left = m->len - c->off, want = left < s->slot_bytes ? left : s->slot_bytes;
        if ((imm >> 24) != (tag & 0xff) || piece != want)
            return fail(s, EPROTO, peer, "rank %d sent a piece of %u bytes of collective tag %u where %llu bytes of "
                        "tag %u were expected", peer, piece, imm >> 24, want, tag & 0xff);
        const void *landed = (const void *)(uintptr_t)(p->ring + (unsigned long long)slot * s->slot_bytes);
        if (m->kind == EV_RECV_REDUCE)
            ev_reduce(dst + c->off, landed, piece, m->op, m->dtype);  /* (checked reducible at the run's start) */
        else
            memcpy(dst + c->off, landed, piece);
        p->used++;
        c->off += piece;
        c->done = c->off >= m->len;
        moved = 1;
    }
    if (p->used - p->reported >= (unsigned)(s->slots / 2 > 0 ? s->slots / 2 : 1)) {
        int rc = credit(s, p, peer);
        if (rc)
            return rc;
    }
    return moved;
}

static int overlap(const ev_msg *a, const ev_msg *b) {
    return a->buf == b->buf && a->at < b->at + b->len && b->at < a->at + a->len;
}

/* Whether send ``k`` of the step [at, end) is one a reducing receive of that step combines into. */
static int staged(const ev_msg *msgs, int at, int end, int k) {
    if (msgs[k].kind != EV_SEND)
        return 0;
    for (int j = at; j < end; j++)
        if (msgs[j].kind == EV_RECV_REDUCE && overlap(&msgs[k], &msgs[j]))
            return 1;
    return 0;
}

/* Such a send is copied first and sent from the copy: the receive may land before the send has gone (the
   core's executor keeps that order instead, such receives landing in scratch memory first). */
static int stage_sends(ev_steps *s, const ev_msg *msgs, int at, int end) {
    size_t need = 0, used = 0;
    for (int k = at; k < end; k++)
        need += staged(msgs, at, end, k) ? msgs[k].len : 0;
    if (need > s->stage_cap) {
        unsigned char *grown = realloc(s->stage, need);
        if (!grown)
            return fail(s, ENOMEM, -1, "out of memory (%zu bytes for a step's sends)", need);
        s->stage = grown;
        s->stage_cap = need;
    }
    for (int k = at; k < end && need; k++)
        if (staged(msgs, at, end, k)) {
            s->cursors[k].from = s->stage + used;
            memcpy(s->stage + used, (const unsigned char *)(uintptr_t)((uintptr_t)s->bases[msgs[k].buf] + msgs[k].at),
                   msgs[k].len);
            used += msgs[k].len;
        }
    return 0;
}

/* Start the step whose first message is ``at``: its copies, in order; its moves' cursors. */
static int start_step(ev_steps *s, const ev_msg *msgs, int count, int at) {
    int end = at;
    s->left = 0;
    for (; end < count && msgs[end].step == msgs[at].step; end++) {
        s->cursors[end] = (cursor_t){0};
        if (msgs[end].kind == EV_COPY) {
            memmove((void *)(uintptr_t)((uintptr_t)s->bases[msgs[end].buf] + msgs[end].at),
                    (const void *)(uintptr_t)((uintptr_t)s->bases[msgs[end].src_buf] + msgs[end].src), msgs[end].len);
            s->cursors[end].done = 1;
        } else {
            s->left++;
        }
    }
    s->at = at;
    s->end = end;
    return stage_sends(s, msgs, at, end);
}

/* Idle past ``spin``: ask for an event at the next completion, look once more (one that came before the
   request makes none), then sleep on the completion channel until one comes or ``seconds`` pass. Everything
   a run waits for is a completion (a piece landed, a credit, a send done), so nothing is missed asleep. */
static int doze(ev_steps *s, double seconds) {
    int rc = ibv_req_notify_cq(s->cq, 0);
    if (rc)
        return fail(s, rc, -1, "ibv_req_notify_cq: %s", strerror(rc));
    rc = progress(s);
    if (rc)
        return rc;
    struct pollfd pfd = {.fd = s->channel->fd, .events = POLLIN};
    if (poll(&pfd, 1, (int)(seconds * 1e3) + 1) > 0) {
        struct ibv_cq *cq;
        void *ctx;
        if (ibv_get_cq_event(s->channel, &cq, &ctx) == 0)  /* (non-blocking: EAGAIN if none) */
            ibv_ack_cq_events(cq, 1);
    }
    return 0;
}

int ev_steps_run(ev_steps *s, const ev_msg *msgs, int count, void *const *bases, unsigned int tag,
                 double budget, int resume) {
    double start = now(), until = start + budget, idle_since = start;
    s->bases = bases;
    s->msgs = msgs;
    if (!resume) {
        for (int i = 0; i < count; i++) {
            if (msgs[i].kind != EV_COPY && (msgs[i].peer < 0 || msgs[i].peer >= s->n || !s->peers[msgs[i].peer].joined))
                return fail(s, EINVAL, msgs[i].peer, "message %d names rank %d, which this path has no link to", i,
                            msgs[i].peer);
            if (msgs[i].kind == EV_RECV_REDUCE && (!ev_reducible(msgs[i].op, msgs[i].dtype)
                                                   || s->slot_bytes % (unsigned)ev_itemsize(msgs[i].dtype)
                                                   || msgs[i].len % (unsigned)ev_itemsize(msgs[i].dtype)))
                return fail(s, EINVAL, msgs[i].peer, "message %d: reduce op %d on dtype %d is not offered here", i,
                            msgs[i].op, msgs[i].dtype);
        }
        if (count > s->ccap) {
            cursor_t *c = realloc(s->cursors, (size_t)count * sizeof *c);
            if (!c)
                return fail(s, ENOMEM, -1, "out of memory");
            s->cursors = c;
            s->ccap = count;
        }
        if (count == 0)
            return 0;
        int rc = start_step(s, msgs, count, 0);
        if (rc < 0)
            return rc;
    }
    cursor_t *cur = s->cursors;
    for (;;) {
        while (s->left == 0) {
            if (s->end >= count)
                return 0;
            int rc = start_step(s, msgs, count, s->end);
            if (rc < 0)
                return rc;
        }
        int moved = 0;
        for (int k = s->at; k < s->end; k++) {
            if (cur[k].done)
                continue;
            /* a receive waits for the earlier ones from its peer (they share its ring); a reducing one also for
               every earlier reducing one (results in the schedule's order, as the executor gives them) */
            int earlier = 0, kind = msgs[k].kind;
            for (int e = s->at; e < k && kind != EV_SEND && !earlier; e++)
                earlier = !cur[e].done && msgs[e].kind != EV_SEND
                          && (msgs[e].peer == msgs[k].peer || (kind == EV_RECV_REDUCE && msgs[e].kind == kind));
            if (earlier)
                continue;
            int rc = kind == EV_SEND ? send_some(s, &msgs[k], &cur[k], tag) : recv_some(s, &msgs[k], &cur[k], tag);
            if (rc < 0)
                return rc;
            moved |= rc;
            s->left -= cur[k].done;
        }
        int rc = progress(s);
        if (rc < 0)
            return rc;
        if (moved || rc) {
            idle_since = now();
            continue;
        }
        double t = now();
        if (t >= until)
            return 1;
        if (t - idle_since < s->spin || !s->channel) {
            sched_yield();
            continue;
        }
        rc = doze(s, until - t);
        if (rc < 0)
            return rc;
        if (rc)
            idle_since = now();
    }
}
