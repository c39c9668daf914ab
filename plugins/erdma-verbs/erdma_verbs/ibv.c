/* libibverbs for erdma-verbs' queue-pair layer (rc.py): a device port, RC queue pairs, memory regions, posts
   and completions, each one C call from Python. Nothing here allocates per request: a post fills the queue
   pair's own request and scatter-gather list and hands them to ibv_post_send (the provider copies them). */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <infiniband/verbs.h>

#include "ibv.h"

#include "ibv_types.h"

static __thread char err[256];

static int fail(int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, sizeof err, fmt, ap);
    va_end(ap);
    if (code == 0)  /* a call that failed without saying why */
        code = EIO;
    return code < 0 ? code : -code;
}

const char *ev_error(void) { return err; }

int ev_device_names(char *out, int len) {
    int n = 0, used = 0;
    struct ibv_device **list = ibv_get_device_list(&n);
    if (!list)
        return fail(errno ? errno : ENOSYS, "ibv_get_device_list: %s", strerror(errno ? errno : ENOSYS));
    out[0] = 0;
    for (int i = 0; i < n; i++) {
        int w = snprintf(out + used, (size_t)(len - used), "%s\n", ibv_get_device_name(list[i]));
        if (w < 0 || w >= len - used) {
            ibv_free_device_list(list);
            return fail(ENOSPC, "the device names do not fit %d bytes", len);
        }
        used += w;
    }
    ibv_free_device_list(list);
    return n;
}

void ev_close(ev_dev *dev) {
    if (!dev)
        return;
    if (dev->cq)
        ibv_destroy_cq(dev->cq);
    if (dev->channel)
        ibv_destroy_comp_channel(dev->channel);
    if (dev->pd)
        ibv_dealloc_pd(dev->pd);
    if (dev->ctx)
        ibv_close_device(dev->ctx);
    free(dev);
}

ev_dev *ev_open(const char *name, int port, int cq_depth, int channel) {
    int n = 0;
    struct ibv_device **list = ibv_get_device_list(&n);
    ev_dev *dev = calloc(1, sizeof *dev);
    if (!list || !dev) {
        fail(errno ? errno : ENOMEM, "listing the devices: %s", strerror(errno ? errno : ENOMEM));
        free(dev);
        if (list)
            ibv_free_device_list(list);
        return NULL;
    }
    dev->port = port;
    int found = 0;
    for (int i = 0; i < n && !found; i++)
        if (strcmp(ibv_get_device_name(list[i]), name) == 0) {
            found = 1;
            dev->ctx = ibv_open_device(list[i]);
            if (!dev->ctx)
                fail(errno, "ibv_open_device: %s", strerror(errno));
        }
    ibv_free_device_list(list);
    if (!found)
        fail(ENODEV, "no such device");
    if (!dev->ctx) {
        free(dev);
        return NULL;
    }
    struct ibv_port_attr attr;
    int rc = ibv_query_port(dev->ctx, (uint8_t)port, &attr);
    if (rc) {
        fail(rc, "port %d: %s", port, strerror(rc));
        goto out;
    }
    dev->gid_tbl_len = attr.gid_tbl_len;
    dev->active_mtu = (int)attr.active_mtu;
    dev->pd = ibv_alloc_pd(dev->ctx);
    if (!dev->pd) {
        fail(errno, "ibv_alloc_pd: %s", strerror(errno));
        goto out;
    }
    if (channel) {
        dev->channel = ibv_create_comp_channel(dev->ctx);
        if (!dev->channel) {
            fail(errno, "ibv_create_comp_channel: %s", strerror(errno));
            goto out;
        }
        /* a wake-up that finds no event (another thread took it) must not block: ev_take_event says 0 */
        int fl = fcntl(dev->channel->fd, F_GETFL);
        if (fl < 0 || fcntl(dev->channel->fd, F_SETFL, fl | O_NONBLOCK) < 0) {
            fail(errno, "making the completion channel non-blocking: %s", strerror(errno));
            goto out;
        }
    }
    dev->cq = ibv_create_cq(dev->ctx, cq_depth, NULL, dev->channel, 0);
    if (!dev->cq) {
        fail(errno, "ibv_create_cq (%d entries): %s", cq_depth, strerror(errno));
        goto out;
    }
    return dev;
out:
    ev_close(dev);
    return NULL;
}

int ev_gid_table_len(ev_dev *dev) { return dev->gid_tbl_len; }

int ev_gid(ev_dev *dev, int index, unsigned char *gid, int *roce_v2) {
    struct ibv_gid_entry entry;
    int rc = ibv_query_gid_ex(dev->ctx, (uint32_t)dev->port, (uint32_t)index, &entry, 0);
    if (rc)
        return fail(rc, "GID %d: %s", index, strerror(rc));
    memcpy(gid, entry.gid.raw, 16);
    *roce_v2 = entry.gid_type == IBV_GID_TYPE_ROCE_V2;
    return 0;
}

int ev_active_mtu(ev_dev *dev) { return dev->active_mtu; }

int ev_channel_fd(ev_dev *dev) { return dev->channel ? dev->channel->fd : -1; }

ev_mr *ev_reg(ev_dev *dev, unsigned long long addr, unsigned long long len, int access) {
    ev_mr *m = malloc(sizeof *m);
    if (!m) {
        fail(ENOMEM, "out of memory");
        return NULL;
    }
    m->mr = ibv_reg_mr(dev->pd, (void *)(uintptr_t)addr, (size_t)len, access);
    if (!m->mr) {
        fail(errno, "ibv_reg_mr: %s", strerror(errno));
        free(m);
        return NULL;
    }
    return m;
}

unsigned int ev_lkey(ev_mr *m) { return m->mr->lkey; }
unsigned int ev_rkey(ev_mr *m) { return m->mr->rkey; }

int ev_dereg(ev_mr *m) {
    int rc = ibv_dereg_mr(m->mr);
    free(m);
    return rc ? fail(rc, "ibv_dereg_mr: %s", strerror(rc)) : 0;
}

ev_qp *ev_qp_new(ev_dev *dev, int send_depth, int recv_depth) {
    ev_qp *q = calloc(1, sizeof *q);
    if (!q) {
        fail(ENOMEM, "out of memory");
        return NULL;
    }
    struct ibv_qp_init_attr init = {
        .send_cq = dev->cq, .recv_cq = dev->cq, .qp_type = IBV_QPT_RC, .sq_sig_all = 0,
        .cap = {.max_send_wr = (uint32_t)send_depth, .max_recv_wr = (uint32_t)recv_depth,
                .max_send_sge = MAX_SEG, .max_recv_sge = 1},
    };
    q->qp = ibv_create_qp(dev->pd, &init);
    if (!q->qp) {
        fail(errno, "ibv_create_qp: %s", strerror(errno));
        free(q);
        return NULL;
    }
    q->swr.sg_list = q->sge;
    return q;
}

unsigned int ev_qpn(ev_qp *q) { return q->qp->qp_num; }

static int modify(ev_qp *q, struct ibv_qp_attr *attr, int mask, const char *state) {
    int rc = ibv_modify_qp(q->qp, attr, mask);
    return rc ? fail(rc, "queue pair %u: the move to %s failed: %s (errno %d)", q->qp->qp_num, state,
                     strerror(rc), rc) : 0;
}

int ev_qp_init(ev_qp *q, int port, int access) {
    struct ibv_qp_attr attr = {.qp_state = IBV_QPS_INIT, .port_num = (uint8_t)port, .pkey_index = 0,
                               .qp_access_flags = (unsigned)access};
    return modify(q, &attr, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS, "INIT");
}

int ev_qp_rtr(ev_qp *q, int port, int mtu, unsigned int dest_qpn, unsigned int rq_psn, const unsigned char *dgid,
              int sgid_index) {
    struct ibv_qp_attr attr = {
        .qp_state = IBV_QPS_RTR, .path_mtu = (enum ibv_mtu)mtu, .dest_qp_num = dest_qpn, .rq_psn = rq_psn,
        .max_dest_rd_atomic = 1, .min_rnr_timer = 12,
        .ah_attr = {.is_global = 1, .port_num = (uint8_t)port,
                    .grh = {.sgid_index = (uint8_t)sgid_index, .hop_limit = 64}},
    };
    memcpy(attr.ah_attr.grh.dgid.raw, dgid, 16);
    return modify(q, &attr, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                  IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER, "RTR");
}

int ev_qp_rts(ev_qp *q, unsigned int sq_psn, int timeout, int retry) {
    struct ibv_qp_attr attr = {.qp_state = IBV_QPS_RTS, .sq_psn = sq_psn, .timeout = (uint8_t)timeout,
                               .retry_cnt = (uint8_t)retry, .rnr_retry = 7, .max_rd_atomic = 1};
    return modify(q, &attr, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                  IBV_QP_MAX_QP_RD_ATOMIC, "RTS");
}

int ev_qp_free(ev_qp *q) {
    int rc = ibv_destroy_qp(q->qp);
    free(q->rwr);
    free(q->rsge);
    free(q);
    return rc ? fail(rc, "ibv_destroy_qp: %s", strerror(rc)) : 0;
}

int ev_post_recv(ev_qp *q, unsigned long long wr_id, unsigned long long addr, unsigned int len, unsigned int lkey,
                 int count) {
    if (count < 1)
        return 0;
    if (count > q->rcap) {
        struct ibv_recv_wr *wr = realloc(q->rwr, (size_t)count * sizeof *wr);
        if (wr)
            q->rwr = wr;
        struct ibv_sge *sge = realloc(q->rsge, (size_t)count * sizeof *sge);
        if (sge)
            q->rsge = sge;
        if (!wr || !sge)
            return fail(ENOMEM, "out of memory");
        q->rcap = count;
    }
    for (int i = 0; i < count; i++) {
        q->rsge[i] = (struct ibv_sge){.addr = addr, .length = len, .lkey = lkey};
        q->rwr[i] = (struct ibv_recv_wr){.wr_id = wr_id, .sg_list = &q->rsge[i], .num_sge = 1,
                                         .next = i + 1 < count ? &q->rwr[i + 1] : NULL};
    }
    struct ibv_recv_wr *bad = NULL;
    int rc = ibv_post_recv(q->qp, q->rwr, &bad);
    return rc ? fail(rc, "queue pair %u: ibv_post_recv: %s", q->qp->qp_num, strerror(rc)) : 0;
}

int ev_post_send(ev_qp *q, int write, unsigned long long wr_id, unsigned int imm, const unsigned long long *seg,
                 int nseg, unsigned long long remote_addr, unsigned int rkey, int signal) {
    if (nseg < 1 || nseg > MAX_SEG)
        return fail(EINVAL, "%d segments (1 to %d)", nseg, MAX_SEG);
    for (int i = 0; i < nseg; i++)
        q->sge[i] = (struct ibv_sge){.addr = seg[3 * i], .length = (uint32_t)seg[3 * i + 1],
                                     .lkey = (uint32_t)seg[3 * i + 2]};
    struct ibv_send_wr *wr = &q->swr;
    wr->wr_id = wr_id;
    wr->next = NULL;
    wr->num_sge = nseg;
    wr->opcode = write ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_SEND_WITH_IMM;
    wr->send_flags = signal ? IBV_SEND_SIGNALED : 0;
    wr->imm_data = imm;  /* carried as is: both ends read it with the same byte order */
    wr->wr.rdma.remote_addr = remote_addr;
    wr->wr.rdma.rkey = rkey;
    struct ibv_send_wr *bad = NULL;
    int rc = ibv_post_send(q->qp, wr, &bad);
    return rc ? fail(rc, "queue pair %u: ibv_post_send: %s", q->qp->qp_num, strerror(rc)) : 0;
}

int ev_poll(ev_dev *dev, ev_wc *out, int max) {
    struct ibv_wc wc[64];
    if (max > 64)
        max = 64;
    int n = ibv_poll_cq(dev->cq, max, wc);
    if (n < 0)
        return fail(EIO, "ibv_poll_cq failed");
    for (int i = 0; i < n; i++)
        out[i] = (ev_wc){.wr_id = wc[i].wr_id, .qp_num = wc[i].qp_num, .status = wc[i].status,
                         .opcode = wc[i].opcode, .byte_len = wc[i].byte_len,
                         .imm_data = (wc[i].wc_flags & IBV_WC_WITH_IMM) ? wc[i].imm_data : 0};
    return n;
}

int ev_arm(ev_dev *dev) {
    int rc = ibv_req_notify_cq(dev->cq, 0);
    return rc ? fail(rc, "ibv_req_notify_cq: %s", strerror(rc)) : 0;
}

int ev_take_event(ev_dev *dev) {
    struct ibv_cq *cq;
    void *cq_ctx;
    if (ibv_get_cq_event(dev->channel, &cq, &cq_ctx))
        return errno == EAGAIN ? 0 : fail(errno, "ibv_get_cq_event: %s", strerror(errno));
    ibv_ack_cq_events(cq, 1);
    return 1;
}

const char *ev_status_name(int status) {
    switch (status) {
#define NAME(s) case IBV_WC_##s: return #s;
    NAME(SUCCESS) NAME(LOC_LEN_ERR) NAME(LOC_QP_OP_ERR) NAME(LOC_EEC_OP_ERR) NAME(LOC_PROT_ERR)
    NAME(WR_FLUSH_ERR) NAME(MW_BIND_ERR) NAME(BAD_RESP_ERR) NAME(LOC_ACCESS_ERR) NAME(REM_INV_REQ_ERR)
    NAME(REM_ACCESS_ERR) NAME(REM_OP_ERR) NAME(RETRY_EXC_ERR) NAME(RNR_RETRY_EXC_ERR) NAME(LOC_RDD_VIOL_ERR)
    NAME(REM_INV_RD_REQ_ERR) NAME(REM_ABORT_ERR) NAME(INV_EECN_ERR) NAME(INV_EEC_STATE_ERR) NAME(FATAL_ERR)
    NAME(RESP_TIMEOUT_ERR) NAME(GENERAL_ERR) NAME(TM_ERR) NAME(TM_RNDV_INCOMPLETE)
#undef NAME
    default: return "";
    }
}
