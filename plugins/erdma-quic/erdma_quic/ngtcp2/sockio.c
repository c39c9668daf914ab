/* The only socket calls of the compiled engine: batch I/O on a UDP socket (sendmmsg, with UDP GSO; recvmmsg)
 * and the address helpers it needs. The connections (shim.c) and the receive table (demux.c) stand on it;
 * it knows neither. */
#define _GNU_SOURCE
#include "sockio.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/udp.h>
#include <string.h>
#include <sys/socket.h>

#define MAX_BATCH 1024 /* datagrams of one sendmmsg or recvmmsg */

int sockio_to_addr(struct sockaddr_storage *ss, const char *host, int port) {
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

socklen_t sockio_addr_len(const struct sockaddr_storage *ss) {
  return ss->ss_family == AF_INET6 ? sizeof(struct sockaddr_in6) : sizeof(struct sockaddr_in);
}

void eq_address(const struct sockaddr_storage *ss, char *host, int *port) {
  if (ss->ss_family == AF_INET6) {
    const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)ss;
    inet_ntop(AF_INET6, &a->sin6_addr, host, 46);
    *port = ntohs(a->sin6_port);
  } else {
    const struct sockaddr_in *a = (const struct sockaddr_in *)ss;
    inet_ntop(AF_INET, &a->sin_addr, host, 46);
    *port = ntohs(a->sin_port);
  }
}

/* ---- batch I/O ------------------------------------------------------------------------------------------ */
static int send_batch(int fd, const uint8_t *buf, size_t stride, const size_t *lens, size_t count, const char *host,
                      int port) {
  struct sockaddr_storage to;
  if (sockio_to_addr(&to, host, port)) return -EINVAL;
  struct mmsghdr msgs[MAX_BATCH];
  struct iovec iov[MAX_BATCH];
  size_t done = 0;
  while (done < count) {
    size_t n = count - done < MAX_BATCH ? count - done : MAX_BATCH;
    memset(msgs, 0, n * sizeof(msgs[0]));
    const uint8_t *at = buf;
    if (!stride) /* packed: skip what was sent */
      for (size_t i = 0; i < done; i++) at += lens[i];
    for (size_t i = 0; i < n; i++) {
      iov[i].iov_base = (void *)(stride ? buf + (done + i) * stride : at);
      if (!stride) at += lens[done + i];
      iov[i].iov_len = lens[done + i];
      msgs[i].msg_hdr.msg_name = &to;
      msgs[i].msg_hdr.msg_namelen = sockio_addr_len(&to);
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

int eq_sendmmsg(int fd, const uint8_t *buf, size_t stride, const size_t *lens, size_t count, const char *host,
                int port) {
  return send_batch(fd, buf, stride, lens, count, host, port);
}

#define GSO_SEGMENTS 64   /* UDP_MAX_SEGMENTS */
#define GSO_BYTES 65000   /* one GSO send is one IP packet before it is cut: under 64 KiB */

int eq_sendmmsg_gso(int fd, const uint8_t *buf, size_t stride, const size_t *lens, size_t count, const char *host,
                    int port) {
  struct sockaddr_storage to;
  if (sockio_to_addr(&to, host, port)) return -EINVAL;
  struct mmsghdr msgs[MAX_BATCH];
  struct iovec iov[MAX_BATCH];
  size_t first[MAX_BATCH + 1]; /* message m carries datagrams first[m] .. first[m + 1] - 1 */
  union {
    char buf[CMSG_SPACE(sizeof(uint16_t))];
    struct cmsghdr align;
  } ctrl[MAX_BATCH];
  size_t done = 0;
  while (done < count) {
    size_t n = 0, i = done;
    memset(msgs, 0, sizeof(msgs[0]) * (count - done < MAX_BATCH ? count - done : MAX_BATCH));
    while (i < count && n < MAX_BATCH) { /* datagrams are contiguous while each before the last fills its stride */
      size_t seg = lens[i], j = i + 1, total = seg;
      while (j < count && j - i < GSO_SEGMENTS && lens[j - 1] == seg && seg == stride && lens[j] <= seg &&
             total + lens[j] <= GSO_BYTES)
        total += lens[j++];
      first[n] = i;
      iov[n].iov_base = (void *)(buf + i * stride);
      iov[n].iov_len = total;
      struct msghdr *h = &msgs[n].msg_hdr;
      h->msg_name = &to;
      h->msg_namelen = sockio_addr_len(&to);
      h->msg_iov = &iov[n];
      h->msg_iovlen = 1;
      if (j - i > 1) {
        h->msg_control = ctrl[n].buf;
        h->msg_controllen = sizeof(ctrl[n].buf);
        struct cmsghdr *cm = CMSG_FIRSTHDR(h);
        cm->cmsg_level = SOL_UDP, cm->cmsg_type = UDP_SEGMENT, cm->cmsg_len = CMSG_LEN(sizeof(uint16_t));
        uint16_t size = (uint16_t)seg;
        memcpy(CMSG_DATA(cm), &size, sizeof(size));
      }
      n++, i = j;
    }
    first[n] = i;
    int sent = sendmmsg(fd, msgs, (unsigned)n, MSG_DONTWAIT);
    if (sent < 0) {
      if (errno == EINTR) continue;
      return done ? (int)done : -errno;
    }
    done = first[sent];
    if ((size_t)sent < n) break; /* the socket's buffer is full: the rest is lost, as on a wire */
  }
  return (int)done;
}

int eq_sendmmsg_packed(int fd, const uint8_t *buf, const size_t *lens, size_t count, const char *host, int port) {
  return send_batch(fd, buf, 0, lens, count, host, port);
}

int sockio_recv_batch(int fd, uint8_t *buf, size_t stride, size_t max, struct mmsghdr *msgs, struct iovec *iov,
               struct sockaddr_storage *from, char *ctrl, size_t ctrl_len) {
  memset(msgs, 0, max * sizeof(msgs[0]));
  for (size_t i = 0; i < max; i++) {
    iov[i].iov_base = buf + i * stride;
    iov[i].iov_len = stride;
    msgs[i].msg_hdr.msg_name = &from[i];
    msgs[i].msg_hdr.msg_namelen = sizeof(from[i]);
    msgs[i].msg_hdr.msg_iov = &iov[i];
    msgs[i].msg_hdr.msg_iovlen = 1;
    if (ctrl) msgs[i].msg_hdr.msg_control = ctrl + i * ctrl_len, msgs[i].msg_hdr.msg_controllen = ctrl_len;
  }
  int got = recvmmsg(fd, msgs, (unsigned)max, MSG_DONTWAIT, NULL);
  if (got < 0) return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : -errno;
  return got;
}

int eq_recvmmsg(int fd, uint8_t *buf, size_t stride, size_t *lens, size_t max, char *hosts, int *ports) {
  if (max > MAX_BATCH) max = MAX_BATCH;
  struct mmsghdr msgs[MAX_BATCH];
  struct iovec iov[MAX_BATCH];
  struct sockaddr_storage from[MAX_BATCH];
  int got = sockio_recv_batch(fd, buf, stride, max, msgs, iov, from, NULL, 0);
  for (int i = 0; i < got; i++) {
    lens[i] = msgs[i].msg_len;
    eq_address(&from[i], hosts + (size_t)i * 46, &ports[i]);
  }
  return got;
}
