/* The receive fast path's connection table (demux.c), as shim.c uses it; eq_demux itself is declared in
 * shim.h, where Python sees it. */
#ifndef ERDMA_QUIC_DEMUX_H
#define ERDMA_QUIC_DEMUX_H
#include <stdint.h>
#include <sys/socket.h>

#include "shim.h"

/* a connection id (CID_LEN bytes) of c's: short-header datagrams carrying it go to c; 0 or -1 (no memory) */
int demux_add(eq_demux *d, const uint8_t *cid, eq_conn *c);
void demux_remove(eq_demux *d, const uint8_t *cid);
void demux_forget(eq_demux *d, eq_conn *c); /* every id of c's (c is being freed) */
/* the table is reference-counted: eq_demux_new's caller holds one, each connection in it one (taken by
 * demux_ref, which returns d); eq_demux_free and demux_unref let go of one, the last frees it */
eq_demux *demux_ref(eq_demux *d);
void demux_unref(eq_demux *d);

/* shim.c: one datagram from `from` into c (as eq_read_from); returns c's token */
int64_t eq_conn_read_one(eq_conn *c, const uint8_t *data, size_t len, const struct sockaddr_storage *from,
                         uint64_t now);
/* shim.c: recvmmsg of up to max datagrams (not waiting) into buf, stride bytes each, with ctrl_len bytes of
 * control space each at ctrl (NULL: none); returns how many (0: none waiting) or -errno */
int recv_batch(int fd, uint8_t *buf, size_t stride, size_t max, struct mmsghdr *msgs, struct iovec *iov,
               struct sockaddr_storage *from, char *ctrl, size_t ctrl_len);
/* shim.c: host (46 bytes) and port of an address */
void eq_address(const struct sockaddr_storage *ss, char *host, int *port);
#endif
