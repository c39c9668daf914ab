/* erdma-quic's compiled QUIC engine: one ngtcp2 connection (TLS 1.3 through GnuTLS) behind a sans-IO surface
 * that moves whole messages. Python hands a message (its memory stays the caller's until EQ_ACKED) and gets
 * whole messages back (EQ_MESSAGE); datagrams go in and out in batches; the time is an argument (ns) and the
 * next deadline is returned (eq_expiry). Nothing here touches a socket: the thin batch I/O a driver may use is sockio.h's. The declarations between the markers are what cffi sees. */
#ifndef ERDMA_QUIC_SHIM_H
#define ERDMA_QUIC_SHIM_H
#include <stddef.h>
#include <stdint.h>

#include "demux.h" /* eq_demux: the receive table a connection keeps its ids in */

/* cdef-begin */
typedef struct eq_conn eq_conn;
typedef struct eq_tickets eq_tickets;

/* EQ_HEAD: a message's first eq_config.head bytes came (data, len) before the rest; the caller may give the
 * rest a place with eq_place, and then gets EQ_PLACED when all of it is there (else the whole message comes
 * as EQ_MESSAGE, origin 1: its head went out before) */
enum { EQ_HANDSHAKE = 1, EQ_MESSAGE = 2, EQ_ACKED = 3, EQ_CLOSED = 4, EQ_TICKET = 5, EQ_HEAD = 6, EQ_PLACED = 7 };
/* how a connection ended (EQ_CLOSED's origin) */
enum { EQ_BY_US = 0, EQ_BY_PEER = 1, EQ_BY_IDLE = 2, EQ_BY_TLS = 3, EQ_BY_ERROR = 4 };
enum { EQ_CC_RENO = 0, EQ_CC_CUBIC = 1, EQ_CC_BBR = 2, EQ_CC_BBR2 = 3 };

typedef struct {
  int kind;
  int64_t handle;  /* MESSAGE, HEAD, PLACED: the stream it came on; ACKED: what eq_send returned */
  uint8_t *data;   /* MESSAGE: the whole message; HEAD: its first bytes; TICKET: a session ticket the listener
                    * gave (for eq_config's ticket); the caller's to free with eq_free_message */
  size_t len;      /* PLACED: the bytes that went to eq_place's buffer */
  uint64_t code;   /* CLOSED: the QUIC or application error code (TLS: the alert); MESSAGE, HEAD, PLACED: the
                    * message's number on its stream (eq_place's seq) */
  int origin;      /* CLOSED: EQ_BY_*; MESSAGE: 1 when an EQ_HEAD gave its head before */
  char reason[256];
} eq_event;

typedef struct {
  const char *cert_pem;  /* this end's certificate chain, PEM */
  size_t cert_len;
  const char *key_pem;   /* its private key, PEM (PKCS#8) */
  size_t key_len;
  const char *ca_pem;    /* the CA the peer's certificate must chain to, PEM; NULL: no check (insecure) */
  size_t ca_len;
  size_t datagram;       /* UDP payload bytes per datagram */
  int cc;                /* EQ_CC_* */
  uint64_t window;       /* flow-control window per connection, bytes */
  uint64_t stream_window; /* and per message */
  const char *server_name; /* dialler: the name the listener's certificate must carry (NULL: none checked) */
  const char *priority;  /* GnuTLS priority string (TLS 1.3 only, ciphers in order); NULL: the default */
  int check_client;      /* listener: 1, TLS requires the dialler's certificate and checks its chain against
                          * ca_pem; 0, TLS asks for it and the caller checks it (eq_peer_certificate) before
                          * it reads anything, so that it can tell the dialler why it refuses */
  uint64_t idle_timeout; /* ns */
  uint64_t handshake_timeout; /* ns */
  uint32_t channels;     /* streams this end sends on (1..64): a lost packet holds up only its own */
  eq_tickets *tickets;   /* listener: issue session tickets sealed with these keys and accept resumption and
                          * 0-RTT data from them; NULL: none */
  const uint8_t *ticket; /* dialler: resume with this ticket (an EQ_TICKET's data) and send 0-RTT; NULL: none */
  size_t ticket_len;
  eq_demux *demux;       /* the endpoint's table the connection keeps its ids in (NULL: none) */
  int64_t token;         /* what eq_demux_recv reports for it */
  size_t head;           /* each received message longer than this many bytes gives them first as EQ_HEAD, so
                          * that the caller can place the rest (eq_place); 0: messages come whole only */
  size_t place_from;     /* only a message at least this long does (a short one costs the caller more in
                          * events than the copy it saves) */
} eq_config;

/* A listener's ticket keys and its record of 0-RTT first flights (each one's early data is accepted once,
 * for as long as a ticket lives): one per endpoint, shared by its connections, used from one thread at a
 * time. NULL on failure. */
eq_tickets *eq_tickets_new(void);
void eq_tickets_free(eq_tickets *t);

/* A connection dialled to remote (an IPv4 or IPv6 literal) from local; NULL with err filled on failure. */
eq_conn *eq_connect(const eq_config *cfg, const char *local_host, int local_port, const char *remote_host,
                    int remote_port, uint64_t now, char *err, size_t errlen);
/* A connection accepted from a client's first datagram (already read into it); NULL with err on failure.
 * odcid (odcid_len bytes; NULL: none) is the destination connection id of the client's Initial before this
 * endpoint answered it with a Retry, read back from the token the caller validated: the connection then says
 * so in its transport parameters (original and retry source ids), and the client's address counts as
 * validated. */
eq_conn *eq_accept(const eq_config *cfg, const char *local_host, int local_port, const char *remote_host,
                   int remote_port, const uint8_t *pkt, size_t len, const uint8_t *odcid, size_t odcid_len,
                   uint64_t now, char *err, size_t errlen);
void eq_free(eq_conn *c);

/* count datagrams from the peer's current address, each at buf + i * stride, lens[i] long; returns 0, or -1
 * once the connection ended */
int eq_read(eq_conn *c, const uint8_t *buf, size_t stride, const size_t *lens, size_t count, uint64_t now);
/* one datagram that came from host:port: ngtcp2 moves the connection to a new address of the peer's once it
 * has validated the path (a datagram's word is not enough) */
int eq_read_from(eq_conn *c, const uint8_t *data, size_t len, const char *host, int port, uint64_t now);
/* up to max datagrams written at buf + i * stride (stride >= the configured datagram), all for one address
 * (eq_destination); returns how many */
size_t eq_write(eq_conn *c, uint8_t *buf, size_t stride, size_t *lens, size_t max, uint64_t now);
int eq_destination(eq_conn *c, char *host, int *port); /* where the latest eq_write's datagrams go (46 bytes) */
int eq_remote(eq_conn *c, char *host, int *port);      /* the peer's address the connection now uses */
uint64_t eq_expiry(eq_conn *c);            /* the next deadline (ns); UINT64_MAX when none */
int eq_handle_expiry(eq_conn *c, uint64_t now);
/* queue a whole message (not copied: data must stay until its EQ_ACKED); returns its handle, or -1 */
int64_t eq_send(eq_conn *c, const uint8_t *data, size_t len);
/* the same for a message in two pieces (a header and a payload), sent as one stream */
int64_t eq_send2(eq_conn *c, const uint8_t *head, size_t head_len, const uint8_t *body, size_t body_len);
int eq_next_event(eq_conn *c, eq_event *ev); /* 1 and fills ev, or 0 */
/* after EQ_HEAD (stream sid, code seq): the message's other bytes (len: its length less the head) go to dst,
 * those that came already at once, the rest as they come, until EQ_PLACED; dst must stay until then or until
 * the connection is freed. -1: that message cannot be placed now (it came whole: its EQ_MESSAGE follows) */
int eq_place(eq_conn *c, int64_t sid, uint64_t seq, uint8_t *dst, size_t len);
void eq_free_message(uint8_t *data);
/* end the connection (the close datagram leaves with the next eq_write) */
void eq_close(eq_conn *c, uint64_t code, const char *reason, uint64_t now);
/* the peer's certificate (DER) once the handshake is done; 0 bytes when it presented none */
size_t eq_peer_certificate(eq_conn *c, const uint8_t **der);
int eq_handshake_done(eq_conn *c);
int eq_ended(eq_conn *c); /* the connection is over (EQ_CLOSED is queued or was taken) */
int eq_resumed(eq_conn *c);                /* the TLS session was resumed from a ticket */
int eq_early_data_accepted(eq_conn *c);    /* the listener took the dialler's 0-RTT data */
/* this end's connection ids (each CID_LEN = 8 bytes, written at ids), at most max; returns how many */
size_t eq_scids(eq_conn *c, uint8_t *ids, size_t max);
uint64_t eq_delivery_rate(eq_conn *c);     /* bytes/s the controller measured (0: none yet) */
size_t eq_queued(eq_conn *c);              /* messages queued and not yet acknowledged */
uint64_t eq_cwnd(eq_conn *c);
uint64_t eq_rtt(eq_conn *c);               /* smoothed RTT, ns */

/* cdef-end */
#endif
