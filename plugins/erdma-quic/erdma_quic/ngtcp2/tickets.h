/* Session tickets of the compiled engine (tickets.c), as shim.c uses them; eq_tickets itself is declared in
 * shim.h, where Python sees it. */
#ifndef ERDMA_QUIC_TICKETS_H
#define ERDMA_QUIC_TICKETS_H
#include <gnutls/gnutls.h>
#include <ngtcp2/ngtcp2.h>

#include "shim.h"

/* listener: seal tickets with t's key, send one after each handshake (tickets_issue), take 0-RTT data from
 * first flights t has not seen; 0 or a GnuTLS error */
int tickets_serve(eq_tickets *t, gnutls_session_t tls);
/* listener, once the handshake is done: send the dialler a ticket for its next connection */
int tickets_issue(gnutls_session_t tls);

/* A ticket as the dialler keeps it: GnuTLS's session data and the transport parameters the listener gave
 * (0-RTT data must stay within them). tickets_pack returns a malloc'd ticket, *len its size (NULL on
 * failure); tickets_unpack sets up tls and tp from one (0, or -1 when it is not a ticket of this engine). */
uint8_t *tickets_pack(gnutls_session_t tls, const ngtcp2_transport_params *tp, size_t *len);
int tickets_unpack(const uint8_t *ticket, size_t len, gnutls_session_t tls, ngtcp2_transport_params *tp);
#endif
