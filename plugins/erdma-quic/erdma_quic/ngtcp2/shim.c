/* The compiled engine: see shim.h. One eq_conn owns an ngtcp2 connection, its GnuTLS session, the queue of
 * messages it sends (pointers to the caller's memory, one unidirectional stream each) and the events it has
 * not handed out yet. */
#define _GNU_SOURCE
#include "shim.h"
#include "demux.h"
#include "sockio.h"
#include "tickets.h"

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

/* Messages travel on a few long-lived unidirectional streams per direction ("channels"), each message
 * prefixed by its length (8 bytes, little-endian): ngtcp2 0.12 never closes a stream the peer opened (fixed
 * in 0.14, commit 1d591bde), so a stream per message would run out of stream credit. A message goes to the
 * channels in turn; a lost packet holds up only its channel's later messages. */
#define MAX_CHANNELS 64
#define PREFIX 8
#define MAX_MESSAGE ((uint64_t)1 << 40)

typedef struct outgoing {
  struct outgoing *next; /* the channel's next message, in stream order */
  int64_t handle;
  int channel;
  uint8_t prefix[PREFIX];
  const uint8_t *part[3]; /* the length prefix, a header, a payload */
  size_t plen[3];
  size_t len, sent;
  uint64_t end; /* the channel's stream offset just after this message */
  int done;     /* every byte written */
} outgoing_t;

typedef struct {
  int64_t stream;            /* -1 until its first message is written */
  uint64_t assigned;         /* bytes of the messages given to it so far */
  outgoing_t *first, *last;  /* its messages not yet acknowledged, in stream order */
} channel_t;

typedef struct incoming {
  struct incoming *next; /* every one of the connection's, to free them */
  int64_t sid;           /* the channel (stream) it reads */
  uint8_t prefix[PREFIX];
  size_t have;           /* prefix bytes read of the message under way */
  uint64_t want;         /* its length, once the prefix is in */
  uint64_t got;          /* its bytes that came so far */
  uint64_t seq;          /* messages begun on the channel (EQ_HEAD's code: eq_place names the one it means) */
  int headed;            /* its first head bytes went out as EQ_HEAD */
  uint8_t *dst;          /* eq_place's: where its bytes after the head go (NULL: into buf) */
  uint8_t *buf;          /* its bytes with no place (yet): grows with what came; kept for the next when placed */
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
  channel_t channels[MAX_CHANNELS];
  int nchannels;
  incoming_t *incoming;
  eq_event *events;
  size_t ehead, elen, ecap;
  int ended;          /* an EQ_CLOSED was queued */
  uint8_t *close_pkt; /* the CONNECTION_CLOSE datagram still to leave */
  size_t close_len;
  struct sockaddr_storage dest; /* where the datagrams of the latest eq_write go */
  uint8_t *held;      /* a datagram eq_write wrote for another address than its batch's: the next batch */
  size_t held_len;
  struct sockaddr_storage held_to;
  char expect[128];   /* dialler: the name the listener's certificate must carry */
  int issue;          /* listener: send a session ticket once the handshake is done */
  int heard;          /* a handshake message of the peer's was decrypted */
  int early;          /* dialler: resuming, with 0-RTT data allowed by early_tp */
  eq_demux *demux;    /* the endpoint's table of connection ids, kept current (NULL: none) */
  int64_t token;      /* what eq_demux_recv reports for this connection */
  size_t head;        /* eq_config's: a message's first bytes that go out alone (EQ_HEAD); 0: none */
  size_t place_from;  /* eq_config's: and only a message at least this long */
  ngtcp2_transport_params early_tp;
};

/* ---- small helpers ---------------------------------------------------------------------------------- */
static void say(char *err, size_t errlen, const char *what, const char *detail) {
  if (err && errlen) snprintf(err, errlen, "%s: %s", what, detail);
}

static int64_t read_one(void *conn, const uint8_t *data, size_t len, const struct sockaddr_storage *from,
                        uint64_t now);

static void set_path(eq_conn *c) {
  c->path.local.addr = (ngtcp2_sockaddr *)&c->local;
  c->path.local.addrlen = sockio_addr_len(&c->local);
  c->path.remote.addr = (ngtcp2_sockaddr *)&c->remote;
  c->path.remote.addrlen = sockio_addr_len(&c->remote);
}

/* the path ngtcp2 now uses (it moves to a peer's new address once that is validated) */
static void follow_path(eq_conn *c) {
  const ngtcp2_path *now = ngtcp2_conn_get_path(c->conn);
  if (now->remote.addrlen && now->remote.addrlen <= sizeof(c->remote)) {
    memcpy(&c->remote, now->remote.addr, now->remote.addrlen);
    set_path(c);
  }
}

static int same_addr(const struct sockaddr_storage *a, const ngtcp2_addr *b) {
  return sockio_addr_len(a) == b->addrlen && memcmp(a, b->addr, b->addrlen) == 0;
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
      const char *name = gnutls_alert_get_name((gnutls_alert_description_t)(peer.error_code & 0xff));
      int n = snprintf(why, sizeof(why), "the peer's TLS refused the handshake: %s (alert %u)", name ? name : "?",
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
    char why[256];
    int n = snprintf(why, sizeof(why), "TLS handshake failed (alert %u)", alert);
    const char *name = gnutls_alert_get_name((gnutls_alert_description_t)alert);
    if (name) n = snprintf(why, sizeof(why), "TLS handshake failed: %s (alert %u)", name, alert);
    unsigned status = gnutls_session_get_verify_cert_status(c->tls); /* (unsigned)-1: nothing was verified */
    gnutls_datum_t text = {NULL, 0};
    if (status && status != (unsigned)-1 && gnutls_certificate_verification_status_print(status, GNUTLS_CRT_X509, &text, 0) == 0) {
      n = snprintf(why, sizeof(why), "the peer's certificate%s%s%s does not verify: %s", c->expect[0] ? " (for " : "",
                   c->expect, c->expect[0] ? ")" : "", text.data);
      gnutls_free(text.data);
    }
    if (n < 0 || (size_t)n >= sizeof(why)) n = (int)strlen(why);
    while (n > 0 && why[n - 1] == ' ') why[--n] = 0;
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
  (void)conn;
  eq_conn *c = ud;
  if (gnutls_rnd(GNUTLS_RND_RANDOM, cid->data, cidlen) != 0) return NGTCP2_ERR_CALLBACK_FAILURE;
  cid->datalen = cidlen;
  if (gnutls_rnd(GNUTLS_RND_RANDOM, token, NGTCP2_STATELESS_RESET_TOKENLEN) != 0) return NGTCP2_ERR_CALLBACK_FAILURE;
  if (c->demux && cidlen == CID_LEN && demux_add(c->demux, cid->data, c) != 0) return NGTCP2_ERR_CALLBACK_FAILURE;
  return 0;
}

static int retire_cid(ngtcp2_conn *conn, const ngtcp2_cid *cid, void *ud) {
  (void)conn;
  eq_conn *c = ud;
  if (c->demux && cid->datalen == CID_LEN) demux_remove(c->demux, cid->data);
  return 0;
}

static int by_handle(const void *a, const void *b) {
  int64_t x = (*(outgoing_t *const *)a)->handle, y = (*(outgoing_t *const *)b)->handle;
  return x < y ? -1 : x > y;
}

/* the listener refused the 0-RTT data: ngtcp2 has forgotten the streams it went on. Every message not yet
 * acknowledged (none can be) goes again from its first byte, on new streams, in the order it was sent. */
static int resend_all(eq_conn *c) {
  size_t n = c->unacked ? c->unacked : 1, k = 0;
  outgoing_t **all = malloc(n * sizeof(*all));
  if (!all) return -1;
  for (int i = 0; i < MAX_CHANNELS; i++) {
    channel_t *ch = &c->channels[i];
    ch->stream = -1, ch->assigned = 0;
    for (outgoing_t *m = ch->first; m && k < n; m = m->next) {
      m->sent = 0, m->done = 0;
      ch->assigned += m->len;
      m->end = ch->assigned;
      all[k++] = m;
    }
  }
  qsort(all, k, sizeof(*all), by_handle);
  free(c->queue);
  c->queue = all, c->qhead = 0, c->qlen = k, c->qcap = n;
  return 0;
}

static int on_crypto_data(ngtcp2_conn *conn, ngtcp2_crypto_level level, uint64_t offset, const uint8_t *data,
                          size_t len, void *ud) {
  ((eq_conn *)ud)->heard = 1;
  return ngtcp2_crypto_recv_crypto_data_cb(conn, level, offset, data, len, ud);
}

static int on_handshake(ngtcp2_conn *conn, void *ud) {
  eq_conn *c = ud;
  if (c->issue && tickets_issue(c->tls) < 0) c->issue = 0; /* no ticket: the next connection is a full one */
  if (c->early && !eq_early_data_accepted(c)) {
    c->early = 0;
    if (ngtcp2_conn_early_data_rejected(conn) != 0 || resend_all(c) != 0) return NGTCP2_ERR_CALLBACK_FAILURE;
  }
  return push_event(c, EQ_HANDSHAKE) ? 0 : NGTCP2_ERR_CALLBACK_FAILURE;
}

/* dialler: the listener sent a session ticket; the caller keeps it for the next connection */
static int on_ticket(gnutls_session_t tls, unsigned htype, unsigned when, unsigned incoming,
                     const gnutls_datum_t *msg) {
  (void)when, (void)incoming, (void)msg;
  if (htype != GNUTLS_HANDSHAKE_NEW_SESSION_TICKET) return 0;
  eq_conn *c = ((ngtcp2_crypto_conn_ref *)gnutls_session_get_ptr(tls))->user_data;
  size_t len = 0;
  uint8_t *ticket = tickets_pack(tls, ngtcp2_conn_get_remote_transport_params(c->conn), &len);
  eq_event *ev = ticket ? push_event(c, EQ_TICKET) : NULL;
  if (!ev) {
    free(ticket);
    return 0;
  }
  ev->data = ticket, ev->len = len;
  return 0;
}

/* n bytes of the message under way that have no place: onto its buffer, which grows with what came */
static int stash(incoming_t *in, const uint8_t *data, size_t n) {
  if (in->len + n > in->cap) {
    size_t cap = in->cap ? in->cap : 65536;
    while (cap < in->len + n) cap *= 2;
    if (cap > in->want) cap = in->want;
    uint8_t *grown = realloc(in->buf, cap);
    if (!grown) return -1;
    in->buf = grown, in->cap = cap;
  }
  if (n) memcpy(in->buf + in->len, data, n);
  in->len += n;
  return 0;
}

/* the message under way came whole: EQ_PLACED where it went to eq_place's buffer (the stream's buffer stays
 * for the next message), else EQ_MESSAGE with all of it (the buffer goes to the caller) */
static int finish(eq_conn *c, incoming_t *in, int64_t sid) {
  eq_event *ev = push_event(c, in->dst ? EQ_PLACED : EQ_MESSAGE);
  if (!ev) return -1;
  ev->handle = sid, ev->code = in->seq, ev->origin = in->headed;
  if (in->dst) {
    ev->len = in->want - c->head;
    in->dst = NULL;
  } else {
    ev->data = in->buf ? in->buf : malloc(1);
    ev->len = in->len;
    in->buf = NULL, in->cap = 0;
  }
  in->len = 0, in->have = 0, in->headed = 0;
  return 0;
}

/* stream data comes in order: length prefixes and messages, one after another. Flow control is given back as
 * it arrives: the peer's window bounds what is in flight, the caller takes messages as they complete. Memory
 * grows with the bytes that came, not with what a prefix claims. */
static int take(eq_conn *c, incoming_t *in, int64_t sid, const uint8_t *data, size_t len) {
  while (len) {
    if (in->have < PREFIX) {
      size_t n = PREFIX - in->have < len ? PREFIX - in->have : len;
      memcpy(in->prefix + in->have, data, n);
      in->have += n, data += n, len -= n;
      if (in->have < PREFIX) return 0;
      in->want = 0;
      for (int i = PREFIX - 1; i >= 0; i--) in->want = in->want << 8 | in->prefix[i];
      if (in->want > MAX_MESSAGE) return NGTCP2_ERR_CALLBACK_FAILURE;
      in->len = 0, in->got = 0, in->seq++;
    }
    size_t n = in->want - in->got < len ? (size_t)(in->want - in->got) : len;
    if (in->dst)
      memcpy(in->dst + (in->got - c->head), data, n);
    else if (stash(in, data, n) != 0)
      return NGTCP2_ERR_CALLBACK_FAILURE;
    in->got += n, data += n, len -= n;
    if (c->head && !in->headed && in->want > c->head && in->want >= c->place_from && in->got >= c->head) {
      eq_event *ev = push_event(c, EQ_HEAD);
      uint8_t *head = malloc(c->head);
      if (!ev || !head) {
        free(head);
        return NGTCP2_ERR_CALLBACK_FAILURE;
      }
      memcpy(head, in->buf, c->head);
      ev->handle = sid, ev->code = in->seq, ev->data = head, ev->len = c->head;
      in->headed = 1;
    }
    if (in->got == in->want && finish(c, in, sid) != 0) return NGTCP2_ERR_CALLBACK_FAILURE;
  }
  return 0;
}

int eq_place(eq_conn *c, int64_t sid, uint64_t seq, uint8_t *dst, size_t len) {
  incoming_t *in = c->incoming;
  while (in && in->sid != sid) in = in->next;
  if (!in || in->seq != seq || !in->headed || in->dst || in->have < PREFIX || in->want - c->head != len)
    return -1; /* that message already came whole (its EQ_MESSAGE is queued), or is not one eq_place can take */
  memcpy(dst, in->buf + c->head, in->len - c->head);
  in->dst = dst;
  return 0;
}

static int on_stream_data(ngtcp2_conn *conn, uint32_t flags, int64_t sid, uint64_t off, const uint8_t *data,
                          size_t len, void *ud, void *sud) {
  (void)off, (void)flags;
  eq_conn *c = ud;
  incoming_t *in = sud;
  if (!in) {
    in = calloc(1, sizeof(*in));
    if (!in) return NGTCP2_ERR_CALLBACK_FAILURE;
    in->sid = sid, in->next = c->incoming, c->incoming = in;
    if (ngtcp2_conn_set_stream_user_data(conn, sid, in) != 0) return NGTCP2_ERR_CALLBACK_FAILURE;
  }
  if (take(c, in, sid, data, len) != 0) return NGTCP2_ERR_CALLBACK_FAILURE;
  ngtcp2_conn_extend_max_stream_offset(conn, sid, len);
  ngtcp2_conn_extend_max_offset(conn, len);
  return 0;
}

/* the peer acknowledged a channel's bytes up to offset + datalen: its messages that end there are done */
static int on_acked(ngtcp2_conn *conn, int64_t sid, uint64_t offset, uint64_t datalen, void *ud, void *sud) {
  (void)conn, (void)sid;
  eq_conn *c = ud;
  channel_t *ch = sud;
  if (!ch) return 0;
  while (ch->first && ch->first->end <= offset + datalen && ch->first->done) {
    outgoing_t *m = ch->first;
    eq_event *ev = push_event(c, EQ_ACKED);
    if (!ev) return NGTCP2_ERR_CALLBACK_FAILURE;
    ev->handle = m->handle;
    ch->first = m->next;
    if (!ch->first) ch->last = NULL;
    c->unacked--;
    free(m);
  }
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
  cb->recv_crypto_data = on_crypto_data;
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
  cb->remove_connection_id = retire_cid;
  cb->recv_stream_data = on_stream_data;
  cb->acked_stream_data_offset = on_acked;
  cb->handshake_completed = on_handshake;
}

/* ---- set-up ------------------------------------------------------------------------------------------ */
static int tls_init(eq_conn *c, const eq_config *cfg, int server, char *err, size_t errlen) {
  static const gnutls_datum_t alpn = {(unsigned char *)"erdma-ngtcp2/1", 14}; /* as streams.ALPNS["ngtcp2"] */
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
  unsigned flags = (server ? GNUTLS_SERVER | GNUTLS_NO_AUTO_SEND_TICKET : GNUTLS_CLIENT) | GNUTLS_ENABLE_EARLY_DATA |
                   GNUTLS_NO_END_OF_EARLY_DATA;
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
  if (server && cfg->tickets) {
    if ((rv = tickets_serve(cfg->tickets, c->tls)) < 0) {
      say(err, errlen, "session tickets", gnutls_strerror(rv));
      return -1;
    }
    c->issue = 1;
  } else if (!server) {
    gnutls_handshake_set_hook_function(c->tls, GNUTLS_HANDSHAKE_NEW_SESSION_TICKET, GNUTLS_HOOK_POST, on_ticket);
    if (cfg->ticket && tickets_unpack(cfg->ticket, cfg->ticket_len, c->tls, &c->early_tp) == 0) c->early = 1;
  }
  if (cfg->ca_pem) {
    /* the chain is checked here, against the CA alone; who the peer is (its rank and job) is the caller's
     * check on eq_peer_certificate */
    if (!server || cfg->check_client) {
      if (server) gnutls_certificate_server_set_request(c->tls, GNUTLS_CERT_REQUIRE);
      gnutls_session_set_verify_cert(c->tls, server ? NULL : cfg->server_name, 0);
    } else {
      gnutls_certificate_server_set_request(c->tls, GNUTLS_CERT_REQUEST);
    }
    if (!server && cfg->server_name) snprintf(c->expect, sizeof(c->expect), "%s", cfg->server_name);
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
  s->no_tx_udp_payload_size_shaping = 1; /* every packet may take the configured size */
  /* PMTUD stays on, though its probes never exceed that size: ngtcp2 0.12 starts it unconditionally when a
   * peer migrates back to its original path, and asserts that it was not turned off (conn_start_pmtud) */
  s->no_pmtud = 0;
  s->max_window = cfg->window;
  s->max_stream_window = cfg->stream_window;
  if (cfg->handshake_timeout) s->handshake_timeout = cfg->handshake_timeout;
  ngtcp2_transport_params_default(tp);
  tp->initial_max_streams_uni = MAX_CHANNELS; /* the peer's channels; never more (none is ever closed) */
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
  c->datagram = cfg->datagram, c->head = cfg->head, c->place_from = cfg->place_from;
  c->nchannels = cfg->channels < 1 ? 1 : cfg->channels > MAX_CHANNELS ? MAX_CHANNELS : (int)cfg->channels;
  for (int k = 0; k < MAX_CHANNELS; k++) c->channels[k].stream = -1;
  if (sockio_to_addr(&c->local, lh, lp) || sockio_to_addr(&c->remote, rh, rp)) {
    say(err, errlen, "address", "not an IPv4 or IPv6 literal");
    free(c);
    return NULL;
  }
  c->demux = cfg->demux ? demux_ref(cfg->demux, read_one) : NULL, c->token = cfg->token; /* eq_free lets go of it */
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
  if (c->early) ngtcp2_conn_set_early_remote_transport_params(c->conn, &c->early_tp);
  if (c->demux && demux_add(c->demux, scid.data, c) != 0) {
    say(err, errlen, "connection ids", "out of memory");
    eq_free(c);
    return NULL;
  }
  return c;
}

eq_conn *eq_accept(const eq_config *cfg, const char *local_host, int local_port, const char *remote_host,
                   int remote_port, const uint8_t *pkt, size_t len, const uint8_t *odcid, size_t odcid_len,
                   uint64_t now, char *err, size_t errlen) {
  ngtcp2_pkt_hd hd;
  int rv = ngtcp2_accept(&hd, pkt, len);
  if (rv != 0) {
    say(err, errlen, "first datagram", "not a QUIC Initial this engine accepts");
    return NULL;
  }
  if (odcid && (odcid_len > NGTCP2_MAX_CIDLEN || !hd.token.len)) {
    say(err, errlen, "first datagram", "a Retry's original connection id without a token");
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
  if (odcid) { /* after a Retry: the Initial goes to the Retry's id; the address is validated by its token */
    ngtcp2_cid_init(&tp.original_dcid, odcid, odcid_len);
    tp.retry_scid = hd.dcid;
    tp.retry_scid_present = 1;
    st.token = hd.token;
  } else {
    tp.original_dcid = hd.dcid;
  }
  rv = ngtcp2_conn_server_new(&c->conn, &hd.scid, &scid, &c->path, hd.version, &cb, &st, &tp, NULL, c);
  if (rv != 0) {
    say(err, errlen, "ngtcp2_conn_server_new", ngtcp2_strerror(rv));
    eq_free(c);
    return NULL;
  }
  ngtcp2_conn_set_tls_native_handle(c->conn, c->tls);
  if (c->demux && demux_add(c->demux, scid.data, c) != 0) {
    say(err, errlen, "connection ids", "out of memory");
    eq_free(c);
    return NULL;
  }
  size_t one = len;
  if (eq_read(c, pkt, len, &one, 1, now) != 0 && c->ended && !c->close_pkt) {
    say(err, errlen, "first datagram", c->elen ? c->events[c->ehead].reason : "refused");
    eq_free(c);
    return NULL;
  }
  if (!c->heard) { /* an Initial's header on what no Initial key opens: nothing to answer, nothing to keep */
    say(err, errlen, "first datagram", "no client Initial could be read from it");
    eq_free(c);
    return NULL;
  }
  return c;
}

void eq_free(eq_conn *c) {
  if (!c) return;
  if (c->demux) { /* first: a batch being read on another thread may hold c */
    demux_forget(c->demux, c);
    demux_unref(c->demux); /* the table goes with its last holder, whichever Python's collector frees last */
  }
  if (c->conn) ngtcp2_conn_del(c->conn);
  for (int k = 0; k < MAX_CHANNELS; k++)
    for (outgoing_t *m = c->channels[k].first, *next; m; m = next) next = m->next, free(m);
  for (incoming_t *in = c->incoming, *next; in; in = next) {
    next = in->next;
    free(in->buf);
    free(in);
  }
  for (size_t i = 0; i < c->elen; i++) {
    eq_event *ev = &c->events[(c->ehead + i) % c->ecap];
    if (ev->kind == EQ_MESSAGE || ev->kind == EQ_TICKET || ev->kind == EQ_HEAD) free(ev->data);
  }
  if (c->tls) gnutls_deinit(c->tls);
  if (c->cred) gnutls_certificate_free_credentials(c->cred);
  free(c->queue);
  free(c->events);
  free(c->close_pkt);
  free(c->held);
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

static int read_from(eq_conn *c, const uint8_t *data, size_t len, const struct sockaddr_storage *from,
                     uint64_t now) {
  if (c->ended) return -1;
  ngtcp2_path path = c->path;
  path.remote.addr = (ngtcp2_sockaddr *)from;
  path.remote.addrlen = sockio_addr_len(from);
  /* ngtcp2 decides whether a new address is the peer's (it validates the path before it moves there) */
  int rv = ngtcp2_conn_read_pkt(c->conn, &path, NULL, data, len, now);
  if (rv == NGTCP2_ERR_DISCARD_PKT || rv == NGTCP2_ERR_DROP_CONN) return 0;
  if (rv != 0) return fail(c, rv, now);
  follow_path(c);
  return 0;
}

int eq_read_from(eq_conn *c, const uint8_t *data, size_t len, const char *host, int port, uint64_t now) {
  struct sockaddr_storage from;
  if (sockio_to_addr(&from, host, port)) return 0;
  return read_from(c, data, len, &from, now);
}

/* the receive table's reader (demux_ref): one datagram into the connection it routed it to */
static int64_t read_one(void *conn, const uint8_t *data, size_t len, const struct sockaddr_storage *from,
                        uint64_t now) {
  eq_conn *c = conn;
  read_from(c, data, len, from, now);
  return c->token;
}

/* the next message to write from position *at of the queue: not done, and on a channel that is not blocked
 * this round (a channel's messages are written in order, so one held up holds its later ones) */
static outgoing_t *pending(eq_conn *c, size_t *at, uint64_t *blocked) {
  for (; *at < c->qlen; (*at)++) {
    outgoing_t *m = c->queue[(c->qhead + *at) % c->qcap];
    if (m->done || (*blocked >> m->channel & 1)) continue;
    channel_t *ch = &c->channels[m->channel];
    if (ch->stream < 0 && ngtcp2_conn_open_uni_stream(c->conn, &ch->stream, ch) != 0) {
      ch->stream = -1; /* no stream credit yet */
      *blocked |= (uint64_t)1 << m->channel;
      continue;
    }
    return m;
  }
  return NULL;
}

/* what is left of m to write, as at most three vectors */
static size_t unsent(const outgoing_t *m, ngtcp2_vec *v) {
  size_t n = 0, skip = m->sent;
  for (int i = 0; i < 3; i++) {
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

/* drop the messages at the front that were written whole (they stay on their channel until acknowledged) */
static void trim(eq_conn *c) {
  while (c->qlen && c->queue[c->qhead]->done) c->qhead = (c->qhead + 1) % c->qcap, c->qlen--;
}

size_t eq_write(eq_conn *c, uint8_t *buf, size_t stride, size_t *lens, size_t max, uint64_t now) {
  size_t count = 0;
  c->dest = c->remote;
  if (c->held && max) { /* written last time for another address: a batch of its own */
    memcpy(buf, c->held, c->held_len < stride ? c->held_len : stride);
    lens[count++] = c->held_len;
    c->dest = c->held_to;
    free(c->held);
    c->held = NULL;
    return count;
  }
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
  uint64_t blocked = 0;
  ngtcp2_path_storage ps;
  ngtcp2_path_storage_zero(&ps);
  while (count < max) {
    uint8_t *dst = buf + count * stride;
    ngtcp2_ssize n = 0;
    for (;;) {
      outgoing_t *m = pending(c, &at, &blocked);
      ngtcp2_vec v[3];
      size_t nv = m ? unsent(m, v) : 0;
      ngtcp2_ssize took = -1;
      int64_t sid = m ? c->channels[m->channel].stream : -1;
      n = ngtcp2_conn_writev_stream(c->conn, &ps.path, NULL, dst, c->datagram, &took,
                                    m ? NGTCP2_WRITE_STREAM_FLAG_MORE : 0, sid, m ? v : NULL, nv, now);
      if (m && took >= 0) {
        m->sent += (size_t)took;
        m->done = m->sent == m->len;
      }
      if (n == NGTCP2_ERR_WRITE_MORE) continue;
      if (m && (n == NGTCP2_ERR_STREAM_DATA_BLOCKED || n == NGTCP2_ERR_STREAM_SHUT_WR)) {
        blocked |= (uint64_t)1 << m->channel; /* waits for the peer's window; try other channels */
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
    if (ps.path.remote.addrlen && ps.path.remote.addrlen <= sizeof(c->dest)) {
      if (!count) {
        memcpy(&c->dest, ps.path.remote.addr, ps.path.remote.addrlen);
      } else if (!same_addr(&c->dest, &ps.path.remote)) { /* a probe of another path: it goes next time */
        c->held = malloc((size_t)n);
        if (c->held) {
          memcpy(c->held, dst, (size_t)n);
          c->held_len = (size_t)n;
          memset(&c->held_to, 0, sizeof(c->held_to));
          memcpy(&c->held_to, ps.path.remote.addr, ps.path.remote.addrlen);
        }
        break;
      }
    }
    lens[count++] = (size_t)n;
    at = 0, blocked = 0; /* a new packet: start again from the oldest message */
  }
  follow_path(c);
  trim(c);
  ngtcp2_conn_update_pkt_tx_time(c->conn, now);
  return count;
}

uint64_t eq_expiry(eq_conn *c) {
  if (c->held) return 0;
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
  uint64_t size = (uint64_t)head_len + body_len;
  for (int i = 0; i < PREFIX; i++) m->prefix[i] = (uint8_t)(size >> (8 * i));
  m->part[0] = m->prefix, m->plen[0] = PREFIX;
  m->part[1] = head, m->plen[1] = head_len, m->part[2] = body, m->plen[2] = body_len;
  m->len = PREFIX + head_len + body_len, m->handle = c->sends++;
  m->channel = (int)(m->handle % c->nchannels);
  channel_t *ch = &c->channels[m->channel];
  ch->assigned += m->len;
  m->end = ch->assigned;
  if (ch->last) ch->last->next = m; else ch->first = m;
  ch->last = m;
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

int eq_destination(eq_conn *c, char *host, int *port) {
  eq_address(&c->dest, host, port);
  return 0;
}

int eq_remote(eq_conn *c, char *host, int *port) {
  eq_address(&c->remote, host, port);
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

int eq_ended(eq_conn *c) { return c->ended; }

int eq_resumed(eq_conn *c) { return gnutls_session_is_resumed(c->tls) != 0; }

int eq_early_data_accepted(eq_conn *c) { return (gnutls_session_get_flags(c->tls) & GNUTLS_SFLAGS_EARLY_DATA) != 0; }

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
