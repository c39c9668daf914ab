/* The compiled engine: see shim.h. One eq_conn owns an ngtcp2 connection, its GnuTLS session, the queue of
 * messages it sends (pointers to the caller's memory, one unidirectional stream each) and the events it has
 * not handed out yet. */
#define _GNU_SOURCE
#include "shim.h"

#include <arpa/inet.h>
#include <errno.h>
#include <gnutls/crypto.h>
#include <gnutls/gnutls.h>
#include <netinet/in.h>
#include <netinet/udp.h>
#include <ngtcp2/ngtcp2.h>
#include <ngtcp2/ngtcp2_crypto.h>
#include <ngtcp2/ngtcp2_crypto_gnutls.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#define PRIORITY "NORMAL:-VERS-ALL:+VERS-TLS1.3"
#define CID_LEN 8
#define MAX_BATCH 1024
#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103
#endif

/* every outgoing_t and incoming_t is on its connection's list of live ones until it is freed, so that
 * eq_free finds those ngtcp2 still holds as stream user data (it calls no stream_close on delete) */
typedef struct live {
  struct live *prev, *next;
  uint8_t **owned; /* an incoming_t's buffer, freed with it */
} live_t;

typedef struct {
  live_t link;
  int64_t handle, stream;
  const uint8_t *part[2]; /* a message is one or two pieces (header, payload) */
  size_t plen[2];
  size_t len, sent;
  int done; /* every byte and the FIN written */
} outgoing_t;

typedef struct {
  live_t link;
  uint8_t *buf;
  size_t len, cap;
} incoming_t;

struct eq_conn {
  ngtcp2_crypto_conn_ref ref;
  ngtcp2_conn *conn;
  gnutls_session_t tls;
  gnutls_certificate_credentials_t cred;
  struct sockaddr_storage local, remote;
  ngtcp2_path path;
  size_t datagram;
  outgoing_t **queue; /* messages not yet written whole, in the order they were sent */
  size_t qhead, qlen, qcap;
  size_t unacked;     /* messages queued and not yet acknowledged */
  int64_t sends;      /* handles given out */
  live_t live;        /* every outgoing_t and incoming_t not yet freed */
  eq_event *events;
  size_t ehead, elen, ecap;
  int ended;          /* an EQ_CLOSED was queued */
  uint8_t *close_pkt; /* the CONNECTION_CLOSE datagram still to leave */
  size_t close_len;
};

/* ---- small helpers ---------------------------------------------------------------------------------- */
static void link_in(eq_conn *c, live_t *l) {
  l->next = c->live.next, l->prev = &c->live;
  c->live.next->prev = l, c->live.next = l;
}

static void unlink_free(live_t *l) {
  l->prev->next = l->next, l->next->prev = l->prev;
  free(l);
}

static void say(char *err, size_t errlen, const char *what, const char *detail) {
  if (err && errlen) snprintf(err, errlen, "%s: %s", what, detail);
}

static int to_addr(struct sockaddr_storage *ss, const char *host, int port) {
  memset(ss, 0, sizeof(*ss));
  struct sockaddr_in *v4 = (struct sockaddr_in *)ss;
  struct sockaddr_in6 *v6 = (struct sockaddr_in6 *)ss;
  if (inet_pton(AF_INET, host, &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    v4->sin_port = htons((uint16_t)port);
    return 0;
  }
  if (inet_pton(AF_INET6, host, &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    v6->sin6_port = htons((uint16_t)port);
    return 0;
  }
  return -1;
}

static socklen_t addr_len(const struct sockaddr_storage *ss) {
  return ss->ss_family == AF_INET6 ? sizeof(struct sockaddr_in6) : sizeof(struct sockaddr_in);
}

static void set_path(eq_conn *c) {
  c->path.local.addr = (ngtcp2_sockaddr *)&c->local;
  c->path.local.addrlen = addr_len(&c->local);
  c->path.remote.addr = (ngtcp2_sockaddr *)&c->remote;
  c->path.remote.addrlen = addr_len(&c->remote);
}

static eq_event *push_event(eq_conn *c, int kind) {
  if (c->elen == c->ecap) {
    size_t cap = c->ecap ? 2 * c->ecap : 64;
    eq_event *grown = malloc(cap * sizeof(eq_event));
    if (!grown) return NULL;
    for (size_t i = 0; i < c->elen; i++) grown[i] = c->events[(c->ehead + i) % c->ecap];
    free(c->events);
    c->events = grown, c->ehead = 0, c->ecap = cap;
  }
  eq_event *ev = &c->events[(c->ehead + c->elen++) % c->ecap];
  memset(ev, 0, sizeof(*ev));
  ev->kind = kind;
  return ev;
}

/* the connection is over: one EQ_CLOSED, and nothing is sent or read after it (but a queued close packet) */
static void ended(eq_conn *c, int origin, uint64_t code, const char *reason, size_t reason_len) {
  if (c->ended) return;
  c->ended = 1;
  eq_event *ev = push_event(c, EQ_CLOSED);
  if (!ev) return;
  ev->origin = origin;
  ev->code = code;
  if (reason) {
    size_t n = reason_len < sizeof(ev->reason) - 1 ? reason_len : sizeof(ev->reason) - 1;
    memcpy(ev->reason, reason, n);
  }
}

static void write_close(eq_conn *c, const ngtcp2_connection_close_error *ccerr, uint64_t now) {
  if (c->close_pkt || ngtcp2_conn_is_in_closing_period(c->conn) || ngtcp2_conn_is_in_draining_period(c->conn)) return;
  uint8_t *pkt = malloc(c->datagram);
  if (!pkt) return;
  ngtcp2_ssize n = ngtcp2_conn_write_connection_close(c->conn, NULL, NULL, pkt, c->datagram, ccerr, now);
  if (n > 0) {
    c->close_pkt = pkt, c->close_len = (size_t)n;
  } else {
    free(pkt);
  }
}

/* an error from ngtcp2 ends the connection, telling the peer why when the connection can still say it */
static int fail(eq_conn *c, int rv, uint64_t now) {
  ngtcp2_connection_close_error ccerr;
  ngtcp2_connection_close_error_default(&ccerr);
  if (rv == NGTCP2_ERR_DRAINING || rv == NGTCP2_ERR_CLOSING) {
    ngtcp2_connection_close_error peer;
    ngtcp2_conn_get_connection_close_error(c->conn, &peer);
    if (!peer.reasonlen && peer.type == NGTCP2_CONNECTION_CLOSE_ERROR_CODE_TYPE_TRANSPORT &&
        (peer.error_code & ~(uint64_t)0xff) == NGTCP2_CRYPTO_ERROR) {
      char why[160];
      int n = snprintf(why, sizeof(why), "the peer's TLS refused the handshake (alert %u)",
                       (unsigned)(peer.error_code & 0xff));
      ended(c, EQ_BY_PEER, peer.error_code, why, (size_t)n);
      return -1;
    }
    ended(c, EQ_BY_PEER, peer.error_code, (const char *)peer.reason, peer.reasonlen);
    return -1;
  }
  if (rv == NGTCP2_ERR_IDLE_CLOSE) {
    ended(c, EQ_BY_IDLE, 0, "idle timeout", 12);
    return -1;
  }
  if (rv == NGTCP2_ERR_CRYPTO) {
    uint8_t alert = ngtcp2_conn_get_tls_alert(c->conn);
    char why[160];
    int n = snprintf(why, sizeof(why), "TLS handshake failed (alert %u)", alert);
    ngtcp2_connection_close_error_set_transport_error_tls_alert(&ccerr, alert, NULL, 0);
    write_close(c, &ccerr, now);
    ended(c, EQ_BY_TLS, alert, why, (size_t)n);
    return -1;
  }
  const char *why = ngtcp2_strerror(rv);
  ngtcp2_connection_close_error_set_transport_error_liberr(&ccerr, rv, NULL, 0);
  write_close(c, &ccerr, now);
  ended(c, EQ_BY_ERROR, (uint64_t)(-rv), why, strlen(why));
  return -1;
}

/* ---- ngtcp2 callbacks ----------------------------------------------------------------------------- */
static ngtcp2_conn *get_conn(ngtcp2_crypto_conn_ref *ref) { return ((eq_conn *)ref->user_data)->conn; }

static void rand_cb(uint8_t *dest, size_t len, const ngtcp2_rand_ctx *ctx) {
  (void)ctx;
  gnutls_rnd(GNUTLS_RND_RANDOM, dest, len);
}

static int new_cid(ngtcp2_conn *conn, ngtcp2_cid *cid, uint8_t *token, size_t cidlen, void *ud) {
  (void)conn, (void)ud;
  if (gnutls_rnd(GNUTLS_RND_RANDOM, cid->data, cidlen) != 0) return NGTCP2_ERR_CALLBACK_FAILURE;
  cid->datalen = cidlen;
  if (gnutls_rnd(GNUTLS_RND_RANDOM, token, NGTCP2_STATELESS_RESET_TOKENLEN) != 0) return NGTCP2_ERR_CALLBACK_FAILURE;
  return 0;
}

static int on_handshake(ngtcp2_conn *conn, void *ud) {
  (void)conn;
  return push_event(ud, EQ_HANDSHAKE) ? 0 : NGTCP2_ERR_CALLBACK_FAILURE;
}

/* stream data comes in order; a message is whole at its FIN. Flow control is given back as it arrives: the
 * peer's window bounds what is in flight, the caller takes messages as they complete. */
static int on_stream_data(ngtcp2_conn *conn, uint32_t flags, int64_t sid, uint64_t off, const uint8_t *data,
                          size_t len, void *ud, void *sud) {
  (void)off;
  eq_conn *c = ud;
  incoming_t *in = sud;
  if (!in) {
    in = calloc(1, sizeof(*in));
    if (!in) return NGTCP2_ERR_CALLBACK_FAILURE;
    link_in(c, &in->link);
    in->link.owned = &in->buf;
    if (ngtcp2_conn_set_stream_user_data(conn, sid, in) != 0) return NGTCP2_ERR_CALLBACK_FAILURE;
  }
  if (in->len + len > in->cap) {
    size_t cap = in->cap ? in->cap : 65536;
    while (cap < in->len + len) cap *= 2;
    uint8_t *grown = realloc(in->buf, cap);
    if (!grown) return NGTCP2_ERR_CALLBACK_FAILURE;
    in->buf = grown, in->cap = cap;
  }
  if (len) memcpy(in->buf + in->len, data, len);
  in->len += len;
  ngtcp2_conn_extend_max_stream_offset(conn, sid, len);
  ngtcp2_conn_extend_max_offset(conn, len);
  if (flags & NGTCP2_STREAM_DATA_FLAG_FIN) {
    eq_event *ev = push_event(c, EQ_MESSAGE);
    if (!ev) return NGTCP2_ERR_CALLBACK_FAILURE;
    ev->handle = sid;
    ev->data = in->buf ? in->buf : malloc(1);
    ev->len = in->len;
    in->buf = NULL, in->len = in->cap = 0;
  }
  return 0;
}

static int on_stream_close(ngtcp2_conn *conn, uint32_t flags, int64_t sid, uint64_t code, void *ud, void *sud) {
  (void)flags, (void)code;
  eq_conn *c = ud;
  if (!ngtcp2_is_bidi_stream(sid) && ngtcp2_conn_is_local_stream(conn, sid)) {
    outgoing_t *m = sud;
    if (m) {
      /* every byte and the FIN acknowledged (or the stream reset, which this engine never does) */
      eq_event *ev = push_event(c, EQ_ACKED);
      if (ev) ev->handle = m->handle;
      c->unacked--;
      unlink_free(&m->link);
    }
    return 0;
  }
  incoming_t *in = sud;
  if (in) {
    free(in->buf);
    unlink_free(&in->link);
  }
  ngtcp2_conn_extend_max_streams_uni(conn, 1);
  return 0;
}

static void callbacks(ngtcp2_callbacks *cb, int server) {
  memset(cb, 0, sizeof(*cb));
  if (server) {
    cb->recv_client_initial = ngtcp2_crypto_recv_client_initial_cb;
  } else {
    cb->client_initial = ngtcp2_crypto_client_initial_cb;
    cb->recv_retry = ngtcp2_crypto_recv_retry_cb;
  }
  cb->recv_crypto_data = ngtcp2_crypto_recv_crypto_data_cb;
  cb->encrypt = ngtcp2_crypto_encrypt_cb;
  cb->decrypt = ngtcp2_crypto_decrypt_cb;
  cb->hp_mask = ngtcp2_crypto_hp_mask_cb;
  cb->update_key = ngtcp2_crypto_update_key_cb;
  cb->delete_crypto_aead_ctx = ngtcp2_crypto_delete_crypto_aead_ctx_cb;
  cb->delete_crypto_cipher_ctx = ngtcp2_crypto_delete_crypto_cipher_ctx_cb;
  cb->get_path_challenge_data = ngtcp2_crypto_get_path_challenge_data_cb;
  cb->version_negotiation = ngtcp2_crypto_version_negotiation_cb;
  cb->rand = rand_cb;
  cb->get_new_connection_id = new_cid;
  cb->recv_stream_data = on_stream_data;
  cb->stream_close = on_stream_close;
  cb->handshake_completed = on_handshake;
}

/* ---- set-up ------------------------------------------------------------------------------------------ */
static int tls_init(eq_conn *c, const eq_config *cfg, int server, char *err, size_t errlen) {
  static const gnutls_datum_t alpn = {(unsigned char *)"erdma", 5};
  gnutls_datum_t cert = {(unsigned char *)cfg->cert_pem, (unsigned)cfg->cert_len};
  gnutls_datum_t key = {(unsigned char *)cfg->key_pem, (unsigned)cfg->key_len};
  int rv;
  if ((rv = gnutls_certificate_allocate_credentials(&c->cred)) < 0 ||
      (rv = gnutls_certificate_set_x509_key_mem2(c->cred, &cert, &key, GNUTLS_X509_FMT_PEM, NULL, 0)) < 0) {
    say(err, errlen, "this rank's certificate or key", gnutls_strerror(rv));
    return -1;
  }
  if (cfg->ca_pem) {
    gnutls_datum_t ca = {(unsigned char *)cfg->ca_pem, (unsigned)cfg->ca_len};
    if ((rv = gnutls_certificate_set_x509_trust_mem(c->cred, &ca, GNUTLS_X509_FMT_PEM)) <= 0) {
      say(err, errlen, "the CA certificate", rv < 0 ? gnutls_strerror(rv) : "no certificate in it");
      return -1;
    }
  }
  unsigned flags = (server ? GNUTLS_SERVER : GNUTLS_CLIENT) | GNUTLS_ENABLE_EARLY_DATA | GNUTLS_NO_END_OF_EARLY_DATA;
  if ((rv = gnutls_init(&c->tls, flags)) < 0) {
    say(err, errlen, "gnutls_init", gnutls_strerror(rv));
    return -1;
  }
  rv = server ? ngtcp2_crypto_gnutls_configure_server_session(c->tls)
              : ngtcp2_crypto_gnutls_configure_client_session(c->tls);
  if (rv != 0 || (rv = gnutls_priority_set_direct(c->tls, cfg->priority ? cfg->priority : PRIORITY, NULL)) < 0 ||
      (rv = gnutls_credentials_set(c->tls, GNUTLS_CRD_CERTIFICATE, c->cred)) < 0 ||
      (rv = gnutls_alpn_set_protocols(c->tls, &alpn, 1, GNUTLS_ALPN_MANDATORY)) < 0) {
    say(err, errlen, "TLS session set-up", rv < 0 ? gnutls_strerror(rv) : "ngtcp2_crypto_gnutls");
    return -1;
  }
  if (cfg->ca_pem) {
    /* the chain is checked here, against the CA alone; who the peer is (its rank and job) is the caller's
     * check on eq_peer_certificate */
    if (server) gnutls_certificate_server_set_request(c->tls, GNUTLS_CERT_REQUIRE);
    gnutls_session_set_verify_cert(c->tls, server ? NULL : cfg->server_name, 0);
  } else if (server) {
    gnutls_certificate_server_set_request(c->tls, GNUTLS_CERT_REQUEST);
  }
  c->ref.get_conn = get_conn;
  c->ref.user_data = c;
  gnutls_session_set_ptr(c->tls, &c->ref);
  return 0;
}

static void settings_for(ngtcp2_settings *s, ngtcp2_transport_params *tp, const eq_config *cfg, uint64_t now) {
  static const ngtcp2_cc_algo algos[] = {NGTCP2_CC_ALGO_RENO, NGTCP2_CC_ALGO_CUBIC, NGTCP2_CC_ALGO_BBR,
                                         NGTCP2_CC_ALGO_BBR2};
  ngtcp2_settings_default(s);
  s->initial_ts = now;
  s->cc_algo = algos[cfg->cc >= 0 && cfg->cc <= 3 ? cfg->cc : EQ_CC_BBR2];
  s->max_tx_udp_payload_size = cfg->datagram;
  s->no_tx_udp_payload_size_shaping = 1;
  s->no_pmtud = 1;
  s->max_window = cfg->window;
  s->max_stream_window = cfg->stream_window;
  if (cfg->handshake_timeout) s->handshake_timeout = cfg->handshake_timeout;
  ngtcp2_transport_params_default(tp);
  tp->initial_max_streams_uni = cfg->streams;
  tp->initial_max_streams_bidi = 0;
  tp->initial_max_stream_data_uni = cfg->stream_window;
  tp->initial_max_data = cfg->window;
  tp->max_idle_timeout = cfg->idle_timeout;
  tp->active_connection_id_limit = 4;
}

static eq_conn *new_conn(const eq_config *cfg, const char *lh, int lp, const char *rh, int rp, int server, char *err,
                         size_t errlen) {
  if (cfg->datagram < 1200 || cfg->datagram > 65527) {
    say(err, errlen, "datagram", "must be 1200..65527 bytes");
    return NULL;
  }
  eq_conn *c = calloc(1, sizeof(*c));
  if (!c) {
    say(err, errlen, "eq_conn", "out of memory");
    return NULL;
  }
  c->datagram = cfg->datagram;
  c->live.next = c->live.prev = &c->live;
  if (to_addr(&c->local, lh, lp) || to_addr(&c->remote, rh, rp)) {
    say(err, errlen, "address", "not an IPv4 or IPv6 literal");
    free(c);
    return NULL;
  }
  set_path(c);
  if (tls_init(c, cfg, server, err, errlen) != 0) {
    eq_free(c);
    return NULL;
  }
  return c;
}

eq_conn *eq_connect(const eq_config *cfg, const char *local_host, int local_port, const char *remote_host,
                    int remote_port, uint64_t now, char *err, size_t errlen) {
  eq_conn *c = new_conn(cfg, local_host, local_port, remote_host, remote_port, 0, err, errlen);
  if (!c) return NULL;
  ngtcp2_callbacks cb;
  ngtcp2_settings st;
  ngtcp2_transport_params tp;
  ngtcp2_cid dcid, scid;
  dcid.datalen = 18, scid.datalen = CID_LEN;
  gnutls_rnd(GNUTLS_RND_RANDOM, dcid.data, dcid.datalen);
  gnutls_rnd(GNUTLS_RND_RANDOM, scid.data, scid.datalen);
  callbacks(&cb, 0);
  settings_for(&st, &tp, cfg, now);
  int rv = ngtcp2_conn_client_new(&c->conn, &dcid, &scid, &c->path, NGTCP2_PROTO_VER_V1, &cb, &st, &tp, NULL, c);
  if (rv != 0) {
    say(err, errlen, "ngtcp2_conn_client_new", ngtcp2_strerror(rv));
    eq_free(c);
    return NULL;
  }
  ngtcp2_conn_set_tls_native_handle(c->conn, c->tls);
  return c;
}

eq_conn *eq_accept(const eq_config *cfg, const char *local_host, int local_port, const char *remote_host,
                   int remote_port, const uint8_t *pkt, size_t len, uint64_t now, char *err, size_t errlen) {
  ngtcp2_pkt_hd hd;
  int rv = ngtcp2_accept(&hd, pkt, len);
  if (rv != 0) {
    say(err, errlen, "first datagram", "not a QUIC Initial this engine accepts");
    return NULL;
  }
  eq_conn *c = new_conn(cfg, local_host, local_port, remote_host, remote_port, 1, err, errlen);
  if (!c) return NULL;
  ngtcp2_callbacks cb;
  ngtcp2_settings st;
  ngtcp2_transport_params tp;
  ngtcp2_cid scid;
  scid.datalen = CID_LEN;
  gnutls_rnd(GNUTLS_RND_RANDOM, scid.data, scid.datalen);
  callbacks(&cb, 1);
  settings_for(&st, &tp, cfg, now);
  tp.original_dcid = hd.dcid;
  rv = ngtcp2_conn_server_new(&c->conn, &hd.scid, &scid, &c->path, hd.version, &cb, &st, &tp, NULL, c);
  if (rv != 0) {
    say(err, errlen, "ngtcp2_conn_server_new", ngtcp2_strerror(rv));
    eq_free(c);
    return NULL;
  }
  ngtcp2_conn_set_tls_native_handle(c->conn, c->tls);
  size_t one = len;
  if (eq_read(c, pkt, len, &one, 1, now) != 0 && c->ended && !c->close_pkt) {
    say(err, errlen, "first datagram", c->elen ? c->events[c->ehead].reason : "refused");
    eq_free(c);
    return NULL;
  }
  return c;
}

void eq_free(eq_conn *c) {
  if (!c) return;
  if (c->conn) ngtcp2_conn_del(c->conn);
  while (c->live.next != &c->live) {
    live_t *l = c->live.next;
    if (l->owned) free(*l->owned);
    unlink_free(l);
  }
  for (size_t i = 0; i < c->elen; i++) {
    eq_event *ev = &c->events[(c->ehead + i) % c->ecap];
    if (ev->kind == EQ_MESSAGE) free(ev->data);
  }
  if (c->tls) gnutls_deinit(c->tls);
  if (c->cred) gnutls_certificate_free_credentials(c->cred);
  free(c->queue);
  free(c->events);
  free(c->close_pkt);
  free(c);
}

/* ---- datagrams in and out ---------------------------------------------------------------------------- */
int eq_read(eq_conn *c, const uint8_t *buf, size_t stride, const size_t *lens, size_t count, uint64_t now) {
  if (c->ended) return -1;
  for (size_t i = 0; i < count; i++) {
    int rv = ngtcp2_conn_read_pkt(c->conn, &c->path, NULL, buf + i * stride, lens[i], now);
    if (rv == NGTCP2_ERR_DISCARD_PKT || rv == NGTCP2_ERR_DROP_CONN) continue;
    if (rv != 0) return fail(c, rv, now);
  }
  return 0;
}

/* the next message with data (or a FIN) still to write, from position *at of the queue */
static outgoing_t *pending(eq_conn *c, size_t *at) {
  while (*at < c->qlen) {
    outgoing_t *m = c->queue[(c->qhead + *at) % c->qcap];
    if (m->stream < 0) {
      if (ngtcp2_conn_open_uni_stream(c->conn, &m->stream, m) != 0) return NULL; /* no stream credit yet */
    }
    if (!m->done) return m;
    (*at)++;
  }
  return NULL;
}

/* what is left of m to write, as at most two vectors */
static size_t unsent(const outgoing_t *m, ngtcp2_vec *v) {
  size_t n = 0, skip = m->sent;
  for (int i = 0; i < 2; i++) {
    if (skip >= m->plen[i]) {
      skip -= m->plen[i];
      continue;
    }
    v[n].base = (uint8_t *)m->part[i] + skip;
    v[n].len = m->plen[i] - skip;
    skip = 0;
    n++;
  }
  return n;
}

/* drop the messages at the front that were written whole (they stay alive until their stream closes) */
static void trim(eq_conn *c) {
  while (c->qlen) {
    outgoing_t *m = c->queue[c->qhead];
    if (!m->done) break;
    c->qhead = (c->qhead + 1) % c->qcap, c->qlen--;
  }
}

size_t eq_write(eq_conn *c, uint8_t *buf, size_t stride, size_t *lens, size_t max, uint64_t now) {
  size_t count = 0;
  if (c->close_pkt && max) {
    memcpy(buf, c->close_pkt, c->close_len < stride ? c->close_len : stride);
    lens[count++] = c->close_len;
    free(c->close_pkt);
    c->close_pkt = NULL;
    return count;
  }
  if (c->ended) return 0;
  size_t quantum = ngtcp2_conn_get_send_quantum(c->conn) / c->datagram;
  if (quantum < 1) quantum = 1;
  if (max > quantum) max = quantum;
  size_t at = 0;
  while (count < max) {
    uint8_t *dst = buf + count * stride;
    ngtcp2_ssize n = 0;
    for (;;) {
      outgoing_t *m = pending(c, &at);
      ngtcp2_vec v[2];
      size_t nv = m ? unsent(m, v) : 0;
      ngtcp2_ssize took = -1;
      uint32_t flags = m ? NGTCP2_WRITE_STREAM_FLAG_MORE | NGTCP2_WRITE_STREAM_FLAG_FIN : 0;
      n = ngtcp2_conn_writev_stream(c->conn, NULL, NULL, dst, c->datagram, &took, flags, m ? m->stream : -1,
                                    m ? v : NULL, nv, now);
      if (m && took >= 0) {
        m->sent += (size_t)took;
        m->done = m->sent == m->len; /* with the FIN: ngtcp2 sets it with the last byte */
      }
      if (n == NGTCP2_ERR_WRITE_MORE) continue;
      if (n == NGTCP2_ERR_STREAM_DATA_BLOCKED || n == NGTCP2_ERR_STREAM_SHUT_WR) {
        at++; /* this stream waits for the peer's window; try the next */
        continue;
      }
      break;
    }
    if (n < 0) {
      fail(c, (int)n, now);
      if (c->close_pkt) continue; /* the close datagram goes out now */
      break;
    }
    if (n == 0) break;
    lens[count++] = (size_t)n;
  }
  trim(c);
  ngtcp2_conn_update_pkt_tx_time(c->conn, now);
  return count;
}

uint64_t eq_expiry(eq_conn *c) {
  if (c->ended) return c->close_pkt ? 0 : UINT64_MAX;
  return ngtcp2_conn_get_expiry(c->conn);
}

int eq_handle_expiry(eq_conn *c, uint64_t now) {
  if (c->ended) return -1;
  if (ngtcp2_conn_get_expiry(c->conn) > now) return 0;
  int rv = ngtcp2_conn_handle_expiry(c->conn, now);
  return rv == 0 ? 0 : fail(c, rv, now);
}

/* ---- messages and events ----------------------------------------------------------------------------- */
int64_t eq_send2(eq_conn *c, const uint8_t *head, size_t head_len, const uint8_t *body, size_t body_len) {
  if (c->ended) return -1;
  if (c->qlen == c->qcap) {
    size_t cap = c->qcap ? 2 * c->qcap : 64;
    outgoing_t **grown = malloc(cap * sizeof(*grown));
    if (!grown) return -1;
    for (size_t i = 0; i < c->qlen; i++) grown[i] = c->queue[(c->qhead + i) % c->qcap];
    free(c->queue);
    c->queue = grown, c->qhead = 0, c->qcap = cap;
  }
  outgoing_t *m = calloc(1, sizeof(*m));
  if (!m) return -1;
  link_in(c, &m->link);
  m->part[0] = head, m->plen[0] = head_len, m->part[1] = body, m->plen[1] = body_len;
  m->len = head_len + body_len, m->stream = -1, m->handle = c->sends++;
  /* its stream is opened when it is first written: the peer's stream credit may not allow it yet */
  c->queue[(c->qhead + c->qlen++) % c->qcap] = m;
  c->unacked++;
  return m->handle;
}

int64_t eq_send(eq_conn *c, const uint8_t *data, size_t len) { return eq_send2(c, data, len, NULL, 0); }

int eq_next_event(eq_conn *c, eq_event *ev) {
  if (!c->elen) return 0;
  *ev = c->events[c->ehead];
  c->ehead = (c->ehead + 1) % c->ecap, c->elen--;
  return 1;
}

void eq_free_message(uint8_t *data) { free(data); }

void eq_close(eq_conn *c, uint64_t code, const char *reason, uint64_t now) {
  if (c->ended) return;
  ngtcp2_connection_close_error ccerr;
  ngtcp2_connection_close_error_default(&ccerr);
  size_t n = reason ? strlen(reason) : 0;
  ngtcp2_connection_close_error_set_application_error(&ccerr, code, (const uint8_t *)reason, n);
  write_close(c, &ccerr, now);
  ended(c, EQ_BY_US, code, reason, n);
}

int eq_set_remote(eq_conn *c, const char *host, int port) {
  if (to_addr(&c->remote, host, port)) return -1;
  set_path(c);
  return 0;
}

size_t eq_peer_certificate(eq_conn *c, const uint8_t **der) {
  unsigned n = 0;
  const gnutls_datum_t *certs = gnutls_certificate_get_peers(c->tls, &n);
  if (!certs || !n) return 0;
  *der = certs[0].data;
  return certs[0].size;
}

int eq_handshake_done(eq_conn *c) { return ngtcp2_conn_get_handshake_completed(c->conn); }

size_t eq_scids(eq_conn *c, uint8_t *ids, size_t max) {
  size_t n = ngtcp2_conn_get_num_scid(c->conn), k = 0;
  ngtcp2_cid *all = calloc(n ? n : 1, sizeof(ngtcp2_cid));
  if (!all) return 0;
  ngtcp2_conn_get_scid(c->conn, all);
  for (size_t i = 0; i < n && k < max; i++)
    if (all[i].datalen == CID_LEN) memcpy(ids + CID_LEN * k++, all[i].data, CID_LEN);
  free(all);
  return k;
}

uint64_t eq_delivery_rate(eq_conn *c) {
  ngtcp2_conn_stat st;
  ngtcp2_conn_get_conn_stat(c->conn, &st);
  return st.delivery_rate_sec;
}

size_t eq_queued(eq_conn *c) { return c->unacked; }

uint64_t eq_cwnd(eq_conn *c) {
  ngtcp2_conn_stat st;
  ngtcp2_conn_get_conn_stat(c->conn, &st);
  return st.cwnd;
}

uint64_t eq_rtt(eq_conn *c) {
  ngtcp2_conn_stat st;
  ngtcp2_conn_get_conn_stat(c->conn, &st);
  return st.smoothed_rtt;
}

/* ---- batch I/O ------------------------------------------------------------------------------------------ */
int eq_sendmmsg(int fd, const uint8_t *buf, size_t stride, const size_t *lens, size_t count, const char *host,
                int port) {
  struct sockaddr_storage to;
  if (to_addr(&to, host, port)) return -EINVAL;
  struct mmsghdr msgs[MAX_BATCH];
  struct iovec iov[MAX_BATCH];
  size_t done = 0;
  while (done < count) {
    size_t n = count - done < MAX_BATCH ? count - done : MAX_BATCH;
    memset(msgs, 0, n * sizeof(msgs[0]));
    for (size_t i = 0; i < n; i++) {
      iov[i].iov_base = (void *)(buf + (done + i) * stride);
      iov[i].iov_len = lens[done + i];
      msgs[i].msg_hdr.msg_name = &to;
      msgs[i].msg_hdr.msg_namelen = addr_len(&to);
      msgs[i].msg_hdr.msg_iov = &iov[i];
      msgs[i].msg_hdr.msg_iovlen = 1;
    }
    int sent = sendmmsg(fd, msgs, (unsigned)n, MSG_DONTWAIT);
    if (sent < 0) {
      if (errno == EINTR) continue;
      return done ? (int)done : -errno;
    }
    done += (size_t)sent;
    if ((size_t)sent < n) break; /* the socket's buffer is full: the rest is lost, as on a wire */
  }
  return (int)done;
}

int eq_recvmmsg(int fd, uint8_t *buf, size_t stride, size_t *lens, size_t max, char *hosts, int *ports) {
  if (max > MAX_BATCH) max = MAX_BATCH;
  struct mmsghdr msgs[MAX_BATCH];
  struct iovec iov[MAX_BATCH];
  struct sockaddr_storage from[MAX_BATCH];
  memset(msgs, 0, max * sizeof(msgs[0]));
  for (size_t i = 0; i < max; i++) {
    iov[i].iov_base = buf + i * stride;
    iov[i].iov_len = stride;
    msgs[i].msg_hdr.msg_name = &from[i];
    msgs[i].msg_hdr.msg_namelen = sizeof(from[i]);
    msgs[i].msg_hdr.msg_iov = &iov[i];
    msgs[i].msg_hdr.msg_iovlen = 1;
  }
  int got = recvmmsg(fd, msgs, (unsigned)max, MSG_DONTWAIT, NULL);
  if (got < 0) return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : -errno;
  for (int i = 0; i < got; i++) {
    lens[i] = msgs[i].msg_len;
    char *h = hosts + (size_t)i * 46;
    if (from[i].ss_family == AF_INET6) {
      struct sockaddr_in6 *a = (struct sockaddr_in6 *)&from[i];
      inet_ntop(AF_INET6, &a->sin6_addr, h, 46);
      ports[i] = ntohs(a->sin6_port);
    } else {
      struct sockaddr_in *a = (struct sockaddr_in *)&from[i];
      inet_ntop(AF_INET, &a->sin_addr, h, 46);
      ports[i] = ntohs(a->sin_port);
    }
  }
  return got;
}
