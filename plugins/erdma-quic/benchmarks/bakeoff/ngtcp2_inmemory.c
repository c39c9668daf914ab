/* ngtcp2 (with GnuTLS) with no sockets: a client and a server connection in one process hand each other's
 * datagrams in memory; the client sends SIZE bytes one way over unidirectional streams of STREAM bytes,
 * all opened at once; virtual time advances 0.5 ms per turn (as benchmarks/quic_inmemory.py does for aioquic).
 * Prints the sender's and the receiver's MB per CPU-second.
 *
 *   ngtcp2_inmemory CERT KEY DATAGRAM SIZE STREAM CC      (CC: reno, cubic, bbr, bbr2)
 */
#include <gnutls/crypto.h>
#include <gnutls/gnutls.h>
#include <ngtcp2/ngtcp2.h>
#include <ngtcp2/ngtcp2_crypto.h>
#include <ngtcp2/ngtcp2_crypto_gnutls.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_BATCH 4096
#define PRIORITY "NORMAL:-VERS-ALL:+VERS-TLS1.3"

typedef struct {
  ngtcp2_crypto_conn_ref ref;
  ngtcp2_conn *conn;
  gnutls_session_t tls;
  gnutls_certificate_credentials_t cred;
  struct sockaddr_in self, other;
  ngtcp2_path path;
  uint64_t received;
  int handshaken;
} peer_t;

typedef struct {
  int64_t id;
  size_t sent;
  int done;
} stream_t;

typedef struct {
  size_t len[MAX_BATCH];
  uint8_t *buf;
  size_t count;
  size_t datagram;
} batch_t;

static uint8_t payload[1 << 24];

static double cpu(void) {
  struct timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec + ts.tv_nsec / 1e9;
}

static ngtcp2_conn *get_conn(ngtcp2_crypto_conn_ref *ref) { return ((peer_t *)ref->user_data)->conn; }

static void rand_cb(uint8_t *dest, size_t len, const ngtcp2_rand_ctx *ctx) {
  (void)ctx;
  gnutls_rnd(GNUTLS_RND_RANDOM, dest, len);
}

static int new_cid(ngtcp2_conn *conn, ngtcp2_cid *cid, uint8_t *token, size_t cidlen, void *ud) {
  (void)conn, (void)ud;
  gnutls_rnd(GNUTLS_RND_RANDOM, cid->data, cidlen);
  cid->datalen = cidlen;
  gnutls_rnd(GNUTLS_RND_RANDOM, token, NGTCP2_STATELESS_RESET_TOKENLEN);
  return 0;
}

static int on_stream_data(ngtcp2_conn *conn, uint32_t flags, int64_t sid, uint64_t off, const uint8_t *data,
                          size_t len, void *ud, void *sud) {
  (void)flags, (void)off, (void)data, (void)sud;
  peer_t *p = ud;
  p->received += len;
  ngtcp2_conn_extend_max_stream_offset(conn, sid, len);
  ngtcp2_conn_extend_max_offset(conn, len);
  return 0;
}

static int on_handshake(ngtcp2_conn *conn, void *ud) {
  (void)conn;
  ((peer_t *)ud)->handshaken = 1;
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
  cb->handshake_completed = on_handshake;
}

static void check(int rv, const char *what) {
  if (rv < 0) {
    fprintf(stderr, "%s: %d\n", what, rv);
    exit(1);
  }
}

static void tls_init(peer_t *p, int server, const char *cert, const char *key) {
  static const gnutls_datum_t alpn = {(unsigned char *)"erdma", 5};
  check(gnutls_certificate_allocate_credentials(&p->cred), "credentials");
  if (server) check(gnutls_certificate_set_x509_key_file(p->cred, cert, key, GNUTLS_X509_FMT_PEM), "key file");
  check(gnutls_init(&p->tls, (server ? GNUTLS_SERVER : GNUTLS_CLIENT) | GNUTLS_ENABLE_EARLY_DATA |
                                 GNUTLS_NO_END_OF_EARLY_DATA), "gnutls_init");
  check(server ? ngtcp2_crypto_gnutls_configure_server_session(p->tls)
               : ngtcp2_crypto_gnutls_configure_client_session(p->tls), "configure");
  check(gnutls_priority_set_direct(p->tls, PRIORITY, NULL), "priority");
  check(gnutls_credentials_set(p->tls, GNUTLS_CRD_CERTIFICATE, p->cred), "credentials_set");
  check(gnutls_alpn_set_protocols(p->tls, &alpn, 1, GNUTLS_ALPN_MANDATORY), "alpn");
  p->ref.get_conn = get_conn;
  p->ref.user_data = p;
  gnutls_session_set_ptr(p->tls, &p->ref);
}

static void addr(struct sockaddr_in *sa, uint32_t ip, uint16_t port) {
  memset(sa, 0, sizeof(*sa));
  sa->sin_family = AF_INET;
  sa->sin_addr.s_addr = htonl(ip);
  sa->sin_port = htons(port);
}

static void path_of(peer_t *p) {
  p->path.local.addr = (ngtcp2_sockaddr *)&p->self;
  p->path.local.addrlen = sizeof(p->self);
  p->path.remote.addr = (ngtcp2_sockaddr *)&p->other;
  p->path.remote.addrlen = sizeof(p->other);
}

static void settings_for(ngtcp2_settings *s, ngtcp2_tstamp now, size_t datagram, ngtcp2_cc_algo cc) {
  ngtcp2_settings_default(s);
  s->initial_ts = now;
  s->cc_algo = cc;
  s->max_tx_udp_payload_size = datagram;
  s->no_pmtud = 1;
  s->max_window = 64 << 20;
  s->max_stream_window = 64 << 20;
}

static void params_for(ngtcp2_transport_params *t, size_t size) {
  ngtcp2_transport_params_default(t);
  t->initial_max_streams_uni = 4096;
  t->initial_max_stream_data_uni = size;
  t->initial_max_data = size;
}

/* packets the server writes (no stream data: ACKs and handshake) */
static void drain(peer_t *p, batch_t *b, ngtcp2_tstamp now) {
  b->count = 0;
  while (b->count < MAX_BATCH) {
    ngtcp2_ssize n = ngtcp2_conn_write_pkt(p->conn, NULL, NULL, b->buf + b->count * b->datagram, b->datagram, now);
    check((int)n, "write_pkt");
    if (n == 0) break;
    b->len[b->count++] = (size_t)n;
  }
}

static void deliver(peer_t *to, batch_t *b, ngtcp2_tstamp now) {
  for (size_t i = 0; i < b->count; i++)
    check(ngtcp2_conn_read_pkt(to->conn, &to->path, NULL, b->buf + i * b->datagram, b->len[i], now), "read_pkt");
}

int main(int argc, char **argv) {
  if (argc != 7) {
    fprintf(stderr, "usage: %s CERT KEY DATAGRAM SIZE STREAM CC\n", argv[0]);
    return 2;
  }
  size_t datagram = strtoul(argv[3], NULL, 10), size = strtoull(argv[4], NULL, 10), stream = strtoull(argv[5], NULL, 10);
  ngtcp2_cc_algo cc = !strcmp(argv[6], "reno") ? NGTCP2_CC_ALGO_RENO : !strcmp(argv[6], "cubic") ? NGTCP2_CC_ALGO_CUBIC
                      : !strcmp(argv[6], "bbr") ? NGTCP2_CC_ALGO_BBR : NGTCP2_CC_ALGO_BBR2;
  if (stream > sizeof(payload)) stream = sizeof(payload);
  size_t nstreams = size / stream;
  stream_t *streams = calloc(nstreams, sizeof(stream_t));
  batch_t out = {.buf = malloc(MAX_BATCH * datagram), .datagram = datagram};
  batch_t back = {.buf = malloc(MAX_BATCH * datagram), .datagram = datagram};
  peer_t client = {0}, server = {0};
  addr(&client.self, 0x0a000001, 1);
  addr(&client.other, 0x0a000002, 2);
  addr(&server.self, 0x0a000002, 2);
  addr(&server.other, 0x0a000001, 1);
  path_of(&client);
  path_of(&server);
  tls_init(&client, 0, NULL, NULL);
  tls_init(&server, 1, argv[1], argv[2]);

  ngtcp2_tstamp now = NGTCP2_SECONDS;
  ngtcp2_callbacks cb;
  ngtcp2_settings st;
  ngtcp2_transport_params tp;
  ngtcp2_cid dcid, scid, sscid;
  dcid.datalen = scid.datalen = sscid.datalen = 18;
  gnutls_rnd(GNUTLS_RND_RANDOM, dcid.data, 18);
  gnutls_rnd(GNUTLS_RND_RANDOM, scid.data, 18);
  gnutls_rnd(GNUTLS_RND_RANDOM, sscid.data, 18);
  callbacks(&cb, 0);
  settings_for(&st, now, datagram, cc);
  params_for(&tp, 2 * size);
  check(ngtcp2_conn_client_new(&client.conn, &dcid, &scid, &client.path, NGTCP2_PROTO_VER_V1, &cb, &st, &tp, NULL,
                               &client), "client_new");
  ngtcp2_conn_set_tls_native_handle(client.conn, client.tls);
  callbacks(&cb, 1);
  settings_for(&st, now, datagram, cc);
  params_for(&tp, 2 * size);
  tp.original_dcid = dcid;
  check(ngtcp2_conn_server_new(&server.conn, &scid, &sscid, &server.path, NGTCP2_PROTO_VER_V1, &cb, &st, &tp, NULL,
                               &server), "server_new");
  ngtcp2_conn_set_tls_native_handle(server.conn, server.tls);

  double cpu_send = 0, cpu_recv = 0;
  size_t opened = 0, next = 0, turns = 0;
  while (server.received < size) {
    if (++turns > 100000000) {
      fprintf(stderr, "no progress: %zu of %zu bytes\n", (size_t)server.received, size);
      return 1;
    }
    now += NGTCP2_MILLISECONDS / 2;
    double a = cpu();
    if (ngtcp2_conn_get_expiry(client.conn) <= now) check(ngtcp2_conn_handle_expiry(client.conn, now), "expiry");
    if (client.handshaken)
      for (; opened < nstreams; opened++)
        if (ngtcp2_conn_open_uni_stream(client.conn, &streams[opened].id, NULL) != 0) break;
    out.count = 0;
    while (out.count < MAX_BATCH) {
      while (next < opened && streams[next].done) next++;
      stream_t *s = next < opened ? &streams[next] : NULL;
      ngtcp2_vec v = {payload + (s ? s->sent : 0), s ? stream - s->sent : 0};
      ngtcp2_ssize took = -1;
      ngtcp2_ssize n = ngtcp2_conn_writev_stream(client.conn, NULL, NULL, out.buf + out.count * datagram, datagram, &took,
                                                 s ? NGTCP2_WRITE_STREAM_FLAG_FIN : 0, s ? s->id : -1, s ? &v : NULL,
                                                 s ? 1 : 0, now);
      if (n == NGTCP2_ERR_STREAM_DATA_BLOCKED) break;
      check((int)n, "writev_stream");
      if (s && took >= 0) {
        s->sent += (size_t)took;
        if (s->sent == stream) s->done = 1;
      }
      if (n == 0) break;
      out.len[out.count++] = (size_t)n;
    }
    double b = cpu();
    deliver(&server, &out, now);
    if (ngtcp2_conn_get_expiry(server.conn) <= now) check(ngtcp2_conn_handle_expiry(server.conn, now), "expiry");
    drain(&server, &back, now);
    double c = cpu();
    deliver(&client, &back, now);
    double d = cpu();
    cpu_send += (b - a) + (d - c);
    cpu_recv += c - b;
  }
  printf("%.1f %.1f\n", size / 1e6 / cpu_send, size / 1e6 / cpu_recv);
  return 0;
}
