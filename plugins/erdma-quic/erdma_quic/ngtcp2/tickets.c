/* Session tickets: see tickets.h. The listener's tickets are GnuTLS's own (sealed with a key it alone holds,
 * carrying the session's secrets and the certificate the dialler proved); a dialler resumes with one and
 * sends its first flight as 0-RTT data. A first flight's early data is taken once: GnuTLS's anti-replay hands
 * each one's binder to first_flight_once, which remembers it for as long as a ticket lives (GnuTLS's own
 * window, which it rolls over, would let a flight replayed across a roll-over in). */
#include "tickets.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

#define LIFETIME 3600        /* seconds a ticket may be used (and a first flight is remembered) */
#define MAX_SEEN 8192        /* first flights remembered; when full, early data waits for the handshake */
#define ID_MAX 64            /* a binder: at most a SHA-384 */
#define KEY_PREFIX 12        /* GnuTLS's anti-replay key: its window's start time, then the binder */
#define MAGIC "eqt1"
#define TP_FIELDS 8

typedef struct {
  uint8_t id[ID_MAX];
  size_t len;
  time_t expires;
} seen_t;

struct eq_tickets {
  gnutls_datum_t key;
  gnutls_anti_replay_t replay;
  seen_t *seen;
  size_t nseen;
};

static int first_flight_once(void *ptr, time_t expires, const gnutls_datum_t *key, const gnutls_datum_t *data) {
  (void)data, (void)expires;
  eq_tickets *t = ptr;
  if (key->size <= KEY_PREFIX || key->size - KEY_PREFIX > ID_MAX) return GNUTLS_E_DB_ERROR;
  const uint8_t *id = key->data + KEY_PREFIX;
  size_t len = key->size - KEY_PREFIX, kept = 0;
  time_t now = time(NULL);
  for (size_t i = 0; i < t->nseen; i++)
    if (t->seen[i].expires >= now) t->seen[kept++] = t->seen[i];
  t->nseen = kept;
  for (size_t i = 0; i < t->nseen; i++)
    if (t->seen[i].len == len && memcmp(t->seen[i].id, id, len) == 0) return GNUTLS_E_DB_ENTRY_EXISTS;
  if (t->nseen == MAX_SEEN) return GNUTLS_E_DB_ERROR;
  seen_t *s = &t->seen[t->nseen++];
  memcpy(s->id, id, len);
  s->len = len;
  s->expires = now + LIFETIME;
  return 0;
}

eq_tickets *eq_tickets_new(void) {
  eq_tickets *t = calloc(1, sizeof(*t));
  if (!t) return NULL;
  t->seen = calloc(MAX_SEEN, sizeof(seen_t));
  if (!t->seen || gnutls_session_ticket_key_generate(&t->key) < 0 || gnutls_anti_replay_init(&t->replay) < 0) {
    eq_tickets_free(t);
    return NULL;
  }
  gnutls_anti_replay_set_window(t->replay, LIFETIME * 1000u);
  gnutls_anti_replay_set_add_function(t->replay, first_flight_once);
  gnutls_anti_replay_set_ptr(t->replay, t);
  return t;
}

void eq_tickets_free(eq_tickets *t) {
  if (!t) return;
  if (t->replay) gnutls_anti_replay_deinit(t->replay);
  if (t->key.data) {
    gnutls_memset(t->key.data, 0, t->key.size);
    gnutls_free(t->key.data);
  }
  free(t->seen);
  free(t);
}

int tickets_serve(eq_tickets *t, gnutls_session_t tls) {
  int rv = gnutls_session_ticket_enable_server(tls, &t->key);
  if (rv < 0) return rv;
  gnutls_anti_replay_enable(tls, t->replay);
  gnutls_db_set_cache_expiration(tls, LIFETIME);
  return gnutls_record_set_max_early_data_size(tls, 0xffffffffu); /* QUIC's value: early data is QUIC's */
}

int tickets_issue(gnutls_session_t tls) { return gnutls_session_ticket_send(tls, 1, 0); }

static void put64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t get64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
  return v;
}

uint8_t *tickets_pack(gnutls_session_t tls, const ngtcp2_transport_params *tp, size_t *len) {
  gnutls_datum_t session = {NULL, 0};
  if (!tp || gnutls_session_get_data2(tls, &session) < 0) return NULL;
  size_t head = 4 + 8 * TP_FIELDS;
  uint8_t *out = malloc(head + session.size);
  if (out) {
    const uint64_t fields[TP_FIELDS] = {tp->initial_max_streams_uni, tp->initial_max_streams_bidi,
                                        tp->initial_max_stream_data_uni, tp->initial_max_stream_data_bidi_local,
                                        tp->initial_max_stream_data_bidi_remote, tp->initial_max_data,
                                        tp->active_connection_id_limit, tp->max_datagram_frame_size};
    memcpy(out, MAGIC, 4);
    for (int i = 0; i < TP_FIELDS; i++) put64(out + 4 + 8 * i, fields[i]);
    memcpy(out + head, session.data, session.size);
    *len = head + session.size;
  }
  gnutls_free(session.data);
  return out;
}

int tickets_unpack(const uint8_t *ticket, size_t len, gnutls_session_t tls, ngtcp2_transport_params *tp) {
  size_t head = 4 + 8 * TP_FIELDS;
  if (len <= head || memcmp(ticket, MAGIC, 4) != 0) return -1;
  const uint8_t *f = ticket + 4;
  memset(tp, 0, sizeof(*tp));
  tp->initial_max_streams_uni = get64(f);
  tp->initial_max_streams_bidi = get64(f + 8);
  tp->initial_max_stream_data_uni = get64(f + 16);
  tp->initial_max_stream_data_bidi_local = get64(f + 24);
  tp->initial_max_stream_data_bidi_remote = get64(f + 32);
  tp->initial_max_data = get64(f + 40);
  tp->active_connection_id_limit = get64(f + 48);
  tp->max_datagram_frame_size = get64(f + 56);
  return gnutls_session_set_data(tls, ticket + head, len - head) < 0 ? -1 : 0;
}
