/* The C side of erdma-dpdk: what Python calls (cffi reads the declarations between the markers). */
/* cdef-begin */
typedef struct eds_ep eds_ep;

typedef struct {
    unsigned long long readable;   /* bytes received in order and not read yet */
    unsigned long long retransmits, duplicates, foreign, sent_packets, received_packets, data_packets;
    int dead;                      /* 1: the link failed (``why`` says how) */
    int pending;                   /* sends queued, or packets not acknowledged yet */
    char why[160];
} eds_link_info;

int eds_eal_init(int argc, char **argv);
const char *eds_error(void);

eds_ep *eds_ep_new(const char *name, int rank, unsigned int job, unsigned int nonce, int frame_bytes,
                   int buffer_bytes, int window, int nb_desc, int links, int ports, int rto_min_us, int rto_max_us,
                   int keepalive_ms, int peer_timeout_ms, int spin_us, int poll_max_us);
int eds_add_port(eds_ep *ep, const char *vdev, const char *args, int watch_link);
int eds_port_mac(eds_ep *ep, int port, unsigned char *mac);
int eds_add_link(eds_ep *ep, int peer, int port, const unsigned char *mac, unsigned int nonce);
int eds_links_up(eds_ep *ep);
int eds_send(eds_ep *ep, int peer, const unsigned char *head, int head_len, const unsigned char *data,
             unsigned long long len, const unsigned char *tail, int tail_len, unsigned long long token, int urgent);
int eds_progress(eds_ep *ep, long long timeout_us);
long long eds_read(eds_ep *ep, int peer, unsigned char *out, long long n, long long sink_min);
long long eds_sink_take(eds_ep *ep, int peer);
int eds_completions(eds_ep *ep, unsigned long long *tokens, int *status, int max);
int eds_drop_queued(eds_ep *ep);
int eds_link_info_get(eds_ep *ep, int peer, eds_link_info *info);
void eds_wake(eds_ep *ep);
void eds_set_loss(eds_ep *ep, unsigned int per_million);
void eds_ep_free(eds_ep *ep);
/* cdef-end */
