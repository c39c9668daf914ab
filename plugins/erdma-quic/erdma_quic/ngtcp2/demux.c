/* The receive fast path: one table per endpoint from each connection id (8 bytes) its connections answer to,
 * to the connection, filled by the connections themselves as ngtcp2 issues and retires ids. eq_demux_recv
 * reads a batch of datagrams and hands each short-header datagram with a known id straight to its
 * connection; the caller sees only which connections were touched, and routes the rest (long headers: new
 * connections and handshakes; unknown ids) itself. Open addressing, linear probing, tombstones. */
#define _GNU_SOURCE
#include "demux.h"
#include "sockio.h"

#include <errno.h>
#include <netinet/in.h>
#include <netinet/udp.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#define CID_LEN 8
#define MAX_BATCH 1024
enum { EMPTY = 0, USED = 1, GONE = 2 };

typedef struct {
  uint64_t key;
  void *conn;
  int state;
} slot_t;

/* The lock: a connection freed by Python's garbage collector on one thread forgets its ids while another
 * thread reads a batch (cffi lets go of the GIL in C); recursive, as a read can issue a connection new ids. */
struct eq_demux {
  pthread_mutex_t lock;
  int refs; /* its Python owner and each connection in it (atomic) */
  demux_reader read; /* where a datagram for a connection in it goes (set by demux_ref) */
  slot_t *slots;
  size_t cap, used, filled; /* used: live entries; filled: live and tombstones */
};

static uint64_t key_of(const uint8_t *cid) {
  uint64_t k;
  memcpy(&k, cid, CID_LEN);
  return k;
}

static size_t slot_of(const eq_demux *d, uint64_t key) {
  uint64_t h = key * 0x9E3779B97F4A7C15ull; /* ids are random: a multiplicative spread is enough */
  return (size_t)(h >> 32) & (d->cap - 1);
}

eq_demux *eq_demux_new(void) {
  eq_demux *d = calloc(1, sizeof(*d));
  if (!d) return NULL;
  d->cap = 256;
  d->refs = 1;
  d->slots = calloc(d->cap, sizeof(slot_t));
  pthread_mutexattr_t attr;
  if (!d->slots || pthread_mutexattr_init(&attr) != 0) {
    free(d->slots);
    free(d);
    return NULL;
  }
  pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_RECURSIVE);
  pthread_mutex_init(&d->lock, &attr);
  pthread_mutexattr_destroy(&attr);
  return d;
}

eq_demux *demux_ref(eq_demux *d, demux_reader read) {
  __atomic_store_n(&d->read, read, __ATOMIC_RELEASE);
  __atomic_add_fetch(&d->refs, 1, __ATOMIC_RELAXED);
  return d;
}

void demux_unref(eq_demux *d) {
  if (__atomic_sub_fetch(&d->refs, 1, __ATOMIC_ACQ_REL) != 0) return;
  pthread_mutex_destroy(&d->lock); /* nobody holds it now: no connection, no reader */
  free(d->slots);
  free(d);
}

void eq_demux_free(eq_demux *d) {
  if (d) demux_unref(d);
}

static int grow(eq_demux *d) {
  size_t cap = d->used * 4 > d->cap ? d->cap * 2 : d->cap; /* many tombstones: rebuild at the same size */
  slot_t *old = d->slots, *slots = calloc(cap, sizeof(slot_t));
  if (!slots) return -1;
  size_t old_cap = d->cap;
  d->slots = slots, d->cap = cap, d->filled = d->used;
  for (size_t i = 0; i < old_cap; i++) {
    if (old[i].state != USED) continue;
    size_t j = slot_of(d, old[i].key);
    while (slots[j].state == USED) j = (j + 1) & (cap - 1);
    slots[j] = old[i];
  }
  free(old);
  return 0;
}

static int add(eq_demux *d, const uint8_t *cid, void *c) {
  if ((d->filled + 1) * 2 > d->cap && grow(d) != 0) return -1;
  uint64_t key = key_of(cid);
  size_t i = slot_of(d, key), free_at = (size_t)-1;
  for (; d->slots[i].state != EMPTY; i = (i + 1) & (d->cap - 1)) {
    if (d->slots[i].state == USED && d->slots[i].key == key) {
      d->slots[i].conn = c;
      return 0;
    }
    if (d->slots[i].state == GONE && free_at == (size_t)-1) free_at = i;
  }
  if (free_at == (size_t)-1) {
    free_at = i;
    d->filled++;
  }
  d->slots[free_at] = (slot_t){key, c, USED};
  d->used++;
  return 0;
}

int demux_add(eq_demux *d, const uint8_t *cid, void *c) {
  pthread_mutex_lock(&d->lock);
  int rv = add(d, cid, c);
  pthread_mutex_unlock(&d->lock);
  return rv;
}

static slot_t *find(eq_demux *d, uint64_t key) {
  for (size_t i = slot_of(d, key); d->slots[i].state != EMPTY; i = (i + 1) & (d->cap - 1))
    if (d->slots[i].state == USED && d->slots[i].key == key) return &d->slots[i];
  return NULL;
}

void demux_remove(eq_demux *d, const uint8_t *cid) {
  pthread_mutex_lock(&d->lock);
  slot_t *s = find(d, key_of(cid));
  if (s) s->state = GONE, s->conn = NULL, d->used--;
  pthread_mutex_unlock(&d->lock);
}

void demux_forget(eq_demux *d, void *c) {
  pthread_mutex_lock(&d->lock);
  for (size_t i = 0; i < d->cap; i++)
    if (d->slots[i].state == USED && d->slots[i].conn == c) d->slots[i].state = GONE, d->slots[i].conn = NULL, d->used--;
  pthread_mutex_unlock(&d->lock);
}

/* one datagram of a batch: into its connection (a short header with a known id) or left for the caller */
static void route(eq_demux *d, demux_reader read, const uint8_t *buf, size_t at, size_t len,
                  const struct sockaddr_storage *from, uint64_t now, eq_recv_out *o) {
  const uint8_t *data = buf + at;
  slot_t *s = len > CID_LEN && !(data[0] & 0x80) ? find(d, key_of(data + 1)) : NULL;
  if (s && read) {
    int64_t token = read(s->conn, data, len, from, now);
    size_t k = 0;
    while (k < o->ntouched && o->touched[k] != token) k++;
    if (k == o->ntouched && k < o->cap) o->touched[o->ntouched++] = token;
    return;
  }
  if (o->nothers == o->cap) return; /* cannot happen (cap: max * UDP_MAX_SEGMENTS); as a loss if it did */
  eq_address(from, o->hosts + o->nothers * 46, &o->ports[o->nothers]);
  o->others[o->nothers] = at, o->olens[o->nothers] = len;
  o->nothers++;
}

int eq_demux_recv(eq_demux *d, int fd, uint8_t *buf, size_t stride, size_t max, uint64_t now, eq_recv_out *o) {
  if (max > MAX_BATCH) max = MAX_BATCH;
  struct mmsghdr msgs[MAX_BATCH];
  struct iovec iov[MAX_BATCH];
  struct sockaddr_storage from[MAX_BATCH];
  union {
    char buf[CMSG_SPACE(sizeof(int))];
    struct cmsghdr align;
  } ctrl[MAX_BATCH];
  o->ntouched = o->nothers = 0;
  int got = sockio_recv_batch(fd, buf, stride, max, msgs, iov, from, ctrl[0].buf, sizeof(ctrl[0]));
  if (got <= 0) return got;
  int datagrams = 0;
  pthread_mutex_lock(&d->lock);
  demux_reader read = __atomic_load_n(&d->read, __ATOMIC_ACQUIRE); /* once a batch, not per datagram */
  for (int i = 0; i < got; i++) {
    size_t len = msgs[i].msg_len, seg = len;
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(&msgs[i].msg_hdr); cm; cm = CMSG_NXTHDR(&msgs[i].msg_hdr, cm))
      if (cm->cmsg_level == SOL_UDP && cm->cmsg_type == UDP_GRO) { /* coalesced by GRO: seg bytes each */
        int size;
        memcpy(&size, CMSG_DATA(cm), sizeof(size));
        if (size > 0) seg = (size_t)size;
      }
    if (seg < len) o->coalesced += (len + seg - 1) / seg;
    for (size_t off = 0; off < len; off += seg, datagrams++)
      route(d, read, buf, (size_t)i * stride + off, len - off < seg ? len - off : seg, &from[i], now, o);
  }
  pthread_mutex_unlock(&d->lock);
  return datagrams;
}
