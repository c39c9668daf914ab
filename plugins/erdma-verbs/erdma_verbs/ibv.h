/* The C side of erdma-verbs: libibverbs driven directly (no pyverbs objects per request). cffi reads the
   declarations between the markers; rc.py is the only caller. Every call that can fail returns a negative
   errno (or NULL) and leaves what failed in ev_error(), on the calling thread. */
/* cdef-begin */
typedef struct ev_dev ev_dev;   /* a device port: context, protection domain, one CQ, an optional channel */
typedef struct ev_qp ev_qp;     /* an RC queue pair with its scatter-gather scratch */
typedef struct ev_mr ev_mr;     /* a memory region */

typedef struct {
    unsigned long long wr_id;
    unsigned int qp_num, status, opcode, byte_len, imm_data;
} ev_wc;

const char *ev_error(void);
int ev_device_names(char *out, int len);   /* the devices' names, each ended by '\n'; their count */
ev_dev *ev_open(const char *name, int port, int cq_depth, int channel);
int ev_gid_table_len(ev_dev *dev);        /* the port's GID table length (queried at open) */
int ev_gid(ev_dev *dev, int index, unsigned char *gid, int *roce_v2);  /* 0, or -ENODATA for an empty entry */
int ev_active_mtu(ev_dev *dev);            /* the port's active MTU as verbs numbers it (IBV_MTU_*; at open) */
int ev_channel_fd(ev_dev *dev);            /* -1 without a channel */
void ev_close(ev_dev *dev);                /* the CQ, channel, PD and context (QPs and MRs first) */

ev_mr *ev_reg(ev_dev *dev, unsigned long long addr, unsigned long long len, int access);
unsigned int ev_lkey(ev_mr *mr);
unsigned int ev_rkey(ev_mr *mr);
int ev_dereg(ev_mr *mr);

ev_qp *ev_qp_new(ev_dev *dev, int send_depth, int recv_depth);
unsigned int ev_qpn(ev_qp *qp);
int ev_qp_init(ev_qp *qp, int port, int access);
int ev_qp_rtr(ev_qp *qp, int port, int mtu, unsigned int dest_qpn, unsigned int rq_psn, const unsigned char *dgid,
              int sgid_index);
int ev_qp_rts(ev_qp *qp, unsigned int sq_psn, int timeout, int retry);
int ev_qp_free(ev_qp *qp);

int ev_post_recv(ev_qp *qp, unsigned long long wr_id, unsigned long long addr, unsigned int len, unsigned int lkey,
                 int count);
/* SEND (remote_addr and rkey 0, opcode 0) or RDMA WRITE (opcode 1) with immediate, from ``nseg`` segments:
   ``seg`` holds (address, length, lkey) for each */
int ev_post_send(ev_qp *qp, int write, unsigned long long wr_id, unsigned int imm, const unsigned long long *seg,
                 int nseg, unsigned long long remote_addr, unsigned int rkey, int signal);
int ev_poll(ev_dev *dev, ev_wc *out, int max);   /* completions taken (0..max) */
int ev_arm(ev_dev *dev);
int ev_take_event(ev_dev *dev);            /* after the channel's fd is readable: 1 when an event was taken */
const char *ev_status_name(int status);    /* IBV_WC_RETRY_EXC_ERR -> "RETRY_EXC_ERR" */


/* A collective's steps in C (steps.c), over queue pairs of their own: ``ev_steps_peer`` for each peer (its
   queue pair connected, its ring's address and rkey, ours, a registered send buffer of slots x slot_bytes),
   then ``ev_steps_run`` per collective: 0 done, 1 the budget spent (call again with ``resume``), negative
   failed (``ev_steps_error``, ``ev_steps_bad_peer``: the rank it concerns or -1). */
#define EV_RECV 0
#define EV_SEND 1
#define EV_COPY 2
#define EV_RECV_REDUCE 3           /* a receive combined into ``at`` by ``op`` on elements of ``dtype`` */
typedef struct ev_steps ev_steps;
typedef struct {
    int step, kind, peer;          /* kind: EV_RECV, EV_SEND, EV_COPY (``src`` to ``at``, first in its step) or
                                      EV_RECV_REDUCE */
    int buf, src_buf;              /* which of the run's buffers (``bases``) ``at`` and ``src`` are in */
    unsigned int len;
    unsigned long long at, src;    /* byte offsets in those buffers */
    int op, dtype;                 /* EV_RECV_REDUCE's */
} ev_msg;
/* reduce.c: the reductions a receive can be combined by (``ev_reducible``), as numpy computes them */
#define EV_SUM 1
#define EV_PROD 2
#define EV_MIN 3
#define EV_MAX 4
#define EV_BAND 5
#define EV_BOR 6
#define EV_BXOR 7
#define EV_INT8 1
#define EV_UINT8 2
#define EV_INT16 3
#define EV_UINT16 4
#define EV_INT32 5
#define EV_UINT32 6
#define EV_INT64 7
#define EV_UINT64 8
#define EV_FLOAT32 9
#define EV_FLOAT64 10
int ev_reducible(int op, int dtype);
int ev_itemsize(int dtype);
int ev_reduce(void *dst, const void *src, unsigned long long nbytes, int op, int dtype);
ev_steps *ev_steps_new(ev_dev *dev, int n, int slots, unsigned int slot_bytes, unsigned long long ctrl_addr,
                       double spin);
int ev_steps_peer(ev_steps *s, int peer, ev_qp *qp, unsigned long long remote, unsigned int rkey,
                  unsigned long long ring, unsigned long long bounce, unsigned int bounce_lkey, unsigned int ctrl_lkey);
int ev_steps_run(ev_steps *s, const ev_msg *msgs, int count, void *const *bases, unsigned int tag,
                 double budget, int resume);
const char *ev_steps_error(ev_steps *s);
int ev_steps_bad_peer(ev_steps *s);
int ev_steps_waiting(ev_steps *s, int *kind);  /* the current step's first move not done */
void ev_steps_free(ev_steps *s);
/* cdef-end */
