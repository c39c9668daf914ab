/* The receive fast path's connection table (demux.c). Python sees the declarations between the markers; the
 * rest is what the connections (shim.c) use to keep their ids in it. It knows a connection only as a pointer
 * and the reader its holders registered: no name of shim.c's. */
#ifndef ERDMA_QUIC_DEMUX_H
#define ERDMA_QUIC_DEMUX_H
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

/* cdef-begin */
typedef struct eq_demux eq_demux;
/* What eq_demux_recv leaves for its caller, in arrays of cap entries: the tokens of the connections that took
 * datagrams (ntouched, each once), and the datagrams it did not route (nothers): the k-th at byte others[k] of
 * the batch buffer, olens[k] long, from hosts + 46 * k, ports[k]. */
typedef struct {
  int64_t *touched;
  size_t *others, *olens;
  char *hosts;
  int *ports;
  size_t cap, ntouched, nothers;
  uint64_t coalesced; /* datagrams that came in a message with others (UDP GRO), counted up */
} eq_recv_out;

/* An endpoint's table from connection ids to its connections, which keep it current; each connection holds a
 * reference to it, so eq_demux_free (the owner's) frees it only once the last connection in it is freed.
 * eq_demux_recv reads up to max messages waiting on fd (recvmmsg, not waiting) into buf (stride bytes each);
 * a message the kernel coalesced (UDP GRO, where the socket asked for it) is split into its datagrams. Each
 * short-header datagram to one of the table's connections goes into it at once (from its sender's address,
 * as eq_read_from); the rest are left in o (cap must be at least max * 64, GRO's most datagrams per
 * message). Returns datagrams read (0: none waiting) or -errno. */
eq_demux *eq_demux_new(void);
void eq_demux_free(eq_demux *d);
int eq_demux_recv(eq_demux *d, int fd, uint8_t *buf, size_t stride, size_t max, uint64_t now, eq_recv_out *o);

/* cdef-end */

/* what a datagram for a connection in the table is handed to: one datagram from `from` into conn; returns the
 * connection's token (what eq_demux_recv reports as touched) */
typedef int64_t (*demux_reader)(void *conn, const uint8_t *data, size_t len, const struct sockaddr_storage *from,
                                uint64_t now);

/* a connection id (CID_LEN bytes) of conn's: short-header datagrams carrying it go to conn; 0 or -1 (no memory) */
int demux_add(eq_demux *d, const uint8_t *cid, void *conn);
void demux_remove(eq_demux *d, const uint8_t *cid);
void demux_forget(eq_demux *d, void *conn); /* every id of conn's (conn is being freed) */
/* the table is reference-counted: eq_demux_new's caller holds one, each connection in it one (taken by
 * demux_ref, which also names the reader its datagrams go to, and returns d); eq_demux_free and demux_unref let
 * go of one, the last frees it */
eq_demux *demux_ref(eq_demux *d, demux_reader read);
void demux_unref(eq_demux *d);
#endif
