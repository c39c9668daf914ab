/* The C side's own structures, shared by ibv.c and steps.c (not seen by cffi). */
#include <infiniband/verbs.h>

#define MAX_SEG 2

struct ev_dev {
    struct ibv_context *ctx;
    struct ibv_pd *pd;
    struct ibv_cq *cq;
    struct ibv_comp_channel *channel;
    int port;
    int gid_tbl_len, active_mtu;  /* the port's, queried once at open */
};

struct ev_qp {
    struct ibv_qp *qp;
    struct ibv_send_wr swr;
    struct ibv_recv_wr *rwr;   /* a chain of receive requests, grown to the longest asked for */
    struct ibv_sge *rsge;
    int rcap;
    struct ibv_sge sge[MAX_SEG];
};

struct ev_mr {
    struct ibv_mr *mr;
};
