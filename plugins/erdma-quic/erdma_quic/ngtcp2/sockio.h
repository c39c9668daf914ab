/* The compiled engine's socket calls (sockio.c): batch I/O on a UDP socket, which a driver uses directly (the
 * declarations between the markers are what cffi sees), and the address helpers shim.c and demux.c share. */
#ifndef ERDMA_QUIC_SOCKIO_H
#define ERDMA_QUIC_SOCKIO_H
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

/* cdef-begin */
/* batch I/O on a UDP socket: sendmmsg of count datagrams to host:port, the i-th at buf + i * stride, lens[i]
 * long; returns datagrams sent (>= 0) or -errno */
int eq_sendmmsg(int fd, const uint8_t *buf, size_t stride, const size_t *lens, size_t count, const char *host,
                int port);
/* eq_sendmmsg with UDP GSO: each run of datagrams of one size (the last may be shorter), as many as one GSO
 * send takes (64, under 64 KiB), goes as one message; returns datagrams sent, or -errno (-EIO and others where
 * the socket or the path cannot take GSO: send them with eq_sendmmsg) */
int eq_sendmmsg_gso(int fd, const uint8_t *buf, size_t stride, const size_t *lens, size_t count, const char *host,
                    int port);
/* the same for datagrams packed back to back in buf (the i-th is lens[i] long) */
int eq_sendmmsg_packed(int fd, const uint8_t *buf, const size_t *lens, size_t count, const char *host, int port);
/* recvmmsg of up to max datagrams without waiting; hosts get each sender's address (46 bytes each), ports its
 * port; returns how many (0: none waiting) or -errno */
int eq_recvmmsg(int fd, uint8_t *buf, size_t stride, size_t *lens, size_t max, char *hosts, int *ports);
/* cdef-end */

/* host (an IPv4 or IPv6 literal) and port into ss; 0, or -1 when host is not an address */
int sockio_to_addr(struct sockaddr_storage *ss, const char *host, int port);
socklen_t sockio_addr_len(const struct sockaddr_storage *ss);
/* host (46 bytes) and port of an address */
void eq_address(const struct sockaddr_storage *ss, char *host, int *port);
/* recvmmsg of up to max datagrams (not waiting) into buf, stride bytes each, with ctrl_len bytes of control space
 * each at ctrl (NULL: none); returns how many (0: none waiting) or -errno */
int sockio_recv_batch(int fd, uint8_t *buf, size_t stride, size_t max, struct mmsghdr *msgs, struct iovec *iov,
                      struct sockaddr_storage *from, char *ctrl, size_t ctrl_len);
#endif
