/* rendezvous_client.c - a node's rendezvous client (the server is
 * rendezvous_server.c, the contract ember/rendezvous.h).
 *
 * Blocking connect/register/wait_spec on the calling thread; then an
 * optional background thread that sends heartbeats, reads STOP and echoes,
 * and enforces EMBER_RDV_EXIT_ON_LOSS. */
#include "ember/rendezvous.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "acceptor.h"
#include "ember/error.h"
#include "ember/net.h"
#include "ember/wire.h"
#include "rendezvous_codec.h"
#include "rendezvous_internal.h"

#define CLIENT_DEFAULT_INTERVAL_MS 1000u
/* After SPEC the server sends only HEARTBEAT, STOP and REFUSED frames. */
#define CLIENT_CONTROL_MAX 65536u

struct ember_rdv_client {
  int fd;
  char peer[96];
  uint32_t self_index;
  int registered;
  pthread_mutex_t wmu; /* serialises writes: report() vs heartbeats */
  pthread_t thread;
  int started;
  int wake_fd; /* created by start(): clients that never start cost one fd */
  _Atomic int64_t stop_state;
  atomic_int quit;
  uint32_t interval_ms, silence_ms, flags;
};

static void kill_self(const char *why) {
  fprintf(stderr, "ember: %s; killing this node's processes\n", why);
  /* The node is its own process-group leader when Ember launched it, and
   * then the whole group (the trainer and its children) must go.  Otherwise
   * killing the group would take down whoever else shares it (a Spark
   * executor, a test runner), so only this process dies. */
  if (getpgrp() == getpid()) kill(-getpgrp(), SIGKILL);
  else kill(getpid(), SIGKILL);
}

int ember_rdv_client_connect(ember_rdv_client **out, const char *host, uint16_t port,
                             const uint8_t *secret, size_t secret_len,
                             int64_t timeout_ms) {
  ember_rdv_client *c = NULL;
  int rc;
  if (out == NULL || host == NULL)
    return ember__set_error(EMBER_EINVAL, "rdv_client_connect: NULL argument");
  *out = NULL;
  int64_t deadline = ember_deadline_after(timeout_ms);
  c = calloc(1, sizeof *c);
  if (c == NULL) return ember__set_error(EMBER_ENOMEM, "rdv_client_connect: out of memory");
  c->fd = c->wake_fd = -1;
  pthread_mutex_init(&c->wmu, NULL);
  atomic_init(&c->stop_state, 0);
  atomic_init(&c->quit, 0);
  rc = ember__connect_auth(host, port, secret, secret_len, deadline, &c->fd);
  if (rc != EMBER_OK) goto fail;
  (void)ember_net_tune(c->fd);
  ember_net_peer_name(c->fd, c->peer, sizeof c->peer);
  *out = c;
  return EMBER_OK;

fail:
  ember_rdv_client_destroy(c);
  return rc;
}

int ember_rdv_client_register(ember_rdv_client *c, const ember_rdv_node *self,
                              int64_t timeout_ms) {
  ember_wire_writer w;
  int rc;
  if (c == NULL || self == NULL)
    return ember__set_error(EMBER_EINVAL, "rdv_client_register: NULL argument");
  int64_t deadline = ember_deadline_after(timeout_ms);
  ember_wire_writer_init(&w);
  rc = ember__rdv_encode_register(&w, self);
  if (rc != EMBER_OK) goto out;
  pthread_mutex_lock(&c->wmu);
  rc = ember_net_send_frame(c->fd, EMBER_MSG_REGISTER, w.buf, (uint32_t)w.len, deadline);
  pthread_mutex_unlock(&c->wmu);
  if (rc == EMBER_OK) {
    c->self_index = self->index;
    c->registered = 1;
  }
out:
  ember_wire_writer_free(&w);
  return rc;
}

int ember_rdv_client_wait_spec(ember_rdv_client *c, ember_rdv_node **nodes,
                               uint32_t *count, uint32_t *self_pos, int64_t timeout_ms) {
  ember_frame_header h;
  uint8_t *p = NULL;
  int rc;
  if (c == NULL || nodes == NULL || count == NULL || self_pos == NULL)
    return ember__set_error(EMBER_EINVAL, "rdv_client_wait_spec: NULL argument");
  *nodes = NULL;
  *count = 0;
  if (c->started)
    return ember__set_error(EMBER_ESTATE, "wait_spec: the client thread already owns the "
                            "connection");
  int64_t deadline = ember_deadline_after(timeout_ms);
  for (;;) {
    free(p);
    p = NULL;
    rc = ember_net_recv_frame(c->fd, EMBER__RDV_SPEC_MAX, &h, &p, deadline);
    if (rc == EMBER_ETIMEDOUT) {
      rc = ember__set_error(EMBER_ETIMEDOUT,
                            "no cluster spec from the driver at %s after %lld ms (not all "
                            "nodes registered?)",
                            c->peer, (long long)timeout_ms);
      goto out;
    }
    if (rc != EMBER_OK) goto out;
    switch (h.type) {
    case EMBER_MSG_SPEC: {
      uint32_t me = 0;
      rc = ember__rdv_decode_spec(p, h.length, &me, nodes, count);
      if (rc != EMBER_OK) goto out;
      if (c->registered && me != c->self_index) {
        free(*nodes);
        *nodes = NULL;
        *count = 0;
        rc = ember__set_error(EMBER_EPROTO, "SPEC from %s is for node %u, we are node %u",
                              c->peer, (unsigned)me, (unsigned)c->self_index);
        goto out;
      }
      *self_pos = me;
      goto out;
    }
    case EMBER_MSG_HEARTBEAT:
      continue;
    case EMBER_MSG_STOP: {
      uint32_t grace = h.length == 4 ? ember_wire_get_u32(p) : 0;
      atomic_store(&c->stop_state, (int64_t)grace + 1);
      rc = ember__set_error(EMBER_EABORTED,
                            "the driver at %s sent STOP (grace %u ms) before the cluster "
                            "spec",
                            c->peer, (unsigned)grace);
      goto out;
    }
    case EMBER_MSG_REFUSED: {
      char reason[EMBER__RDV_REASON_MAX + 1];
      int st = EMBER_EPROTO;
      if (ember__rdv_decode_refused(p, h.length, &st, reason, sizeof reason) != EMBER_OK)
        snprintf(reason, sizeof reason, "(malformed REFUSED frame)");
      rc = ember__set_error(st, "registration refused by the driver at %s: %s", c->peer,
                            reason);
      goto out;
    }
    default:
      rc = ember__set_error(EMBER_EPROTO, "expected SPEC from %s, got %s", c->peer,
                            ember_wire_type_name(h.type));
      goto out;
    }
  }
out:
  free(p);
  return rc;
}

/* The client thread: heartbeats out, echoes/STOP in, loss and grace timers. */
static void *client_main(void *arg) {
  ember_rdv_client *c = arg;
  ember_wire_parser *parser = NULL;
  uint8_t buf[4096];
  int alive = 1;
  const int exit_on_loss = (c->flags & EMBER_RDV_EXIT_ON_LOSS) != 0;
  const int64_t interval = c->interval_ms;
  const int64_t silence = c->silence_ms ? (int64_t)c->silence_ms : 3 * interval + 5000;
  int64_t now = ember_now_ms();
  int64_t last_heard = now, next_hb = now, stop_deadline = INT64_MAX;

  if (ember_wire_parser_create(&parser, CLIENT_CONTROL_MAX) != EMBER_OK) alive = 0;
  while (!atomic_load(&c->quit)) {
    char why[256] = "";
    now = ember_now_ms();
    if (alive && now >= next_hb) {
      int64_t d = now + (interval > 1000 ? interval : 1000);
      pthread_mutex_lock(&c->wmu);
      int rc = ember_net_send_frame(c->fd, EMBER_MSG_HEARTBEAT, NULL, 0, d);
      pthread_mutex_unlock(&c->wmu);
      if (rc != EMBER_OK) snprintf(why, sizeof why, "%s", ember_last_error());
      next_hb = now + interval;
    }
    if (alive && !why[0] && now - last_heard >= silence)
      snprintf(why, sizeof why, "driver at %s silent for %lld ms", c->peer,
               (long long)(now - last_heard));

    if (alive && !why[0]) {
      struct pollfd pf[2] = {{.fd = c->wake_fd, .events = POLLIN, .revents = 0},
                             {.fd = c->fd, .events = POLLIN, .revents = 0}};
      int64_t until = next_hb < last_heard + silence ? next_hb : last_heard + silence;
      if (exit_on_loss && stop_deadline < until) until = stop_deadline;
      int timeout = until <= now ? 0 : (int)(until - now > 60000 ? 60000 : until - now);
      int pr = poll(pf, 2, timeout);
      if (pr > 0 && pf[0].revents) ember__rdv_drain(c->wake_fd);
      if (pr > 0 && pf[1].revents) {
        ssize_t n = recv(c->fd, buf, sizeof buf, 0);
        if (n == 0) {
          snprintf(why, sizeof why, "driver at %s closed the control connection", c->peer);
        } else if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
          snprintf(why, sizeof why, "recv from driver at %s: %s", c->peer, strerror(errno));
        } else if (n > 0) {
          if (ember_wire_parser_feed(parser, buf, (size_t)n) != EMBER_OK) {
            snprintf(why, sizeof why, "bad frame from driver at %s: %s", c->peer,
                     ember_last_error());
          } else {
            ember_frame_header h;
            const uint8_t *p;
            last_heard = ember_now_ms();
            while (!why[0] && ember_wire_parser_next(parser, &h, &p) == 1) {
              if (h.type == EMBER_MSG_STOP && h.length == 4) {
                uint32_t grace = ember_wire_get_u32(p);
                if (atomic_load(&c->stop_state) <= 0) {
                  atomic_store(&c->stop_state, (int64_t)grace + 1);
                  stop_deadline = last_heard + grace;
                }
              } else if (h.type == EMBER_MSG_REFUSED) {
                snprintf(why, sizeof why, "driver at %s refused this node", c->peer);
              }
              /* HEARTBEAT echoes only refresh last_heard; other types are
               * ignored for forward compatibility. */
            }
          }
        }
      }
    } else if (!alive) {
      /* Connection gone: wait for destroy(), or the end of a STOP's grace. */
      int64_t until = exit_on_loss ? stop_deadline : INT64_MAX;
      int timeout = until == INT64_MAX ? -1
                    : until <= now      ? 0
                                        : (int)(until - now > 60000 ? 60000 : until - now);
      struct pollfd pf = {.fd = c->wake_fd, .events = POLLIN, .revents = 0};
      if (poll(&pf, 1, timeout) > 0) ember__rdv_drain(c->wake_fd);
    }

    if (why[0] && alive) {
      alive = 0;
      int64_t expect = 0;
      /* A STOP already received keeps its grace period: the driver closing
       * the connection after STOP is the normal shutdown path. */
      if (atomic_compare_exchange_strong(&c->stop_state, &expect, -1) && exit_on_loss)
        kill_self(why);
    }
    if (exit_on_loss && ember_now_ms() >= stop_deadline && !atomic_load(&c->quit))
      kill_self("the STOP grace period ran out");
  }
  ember_wire_parser_destroy(parser);
  return NULL;
}

int ember_rdv_client_start(ember_rdv_client *c, uint32_t interval_ms, uint32_t silence_ms,
                           uint32_t flags) {
  if (c == NULL) return ember__set_error(EMBER_EINVAL, "rdv_client_start: NULL client");
  if (c->started) return ember__set_error(EMBER_ESTATE, "rdv_client_start: already started");
  c->interval_ms = interval_ms ? interval_ms : CLIENT_DEFAULT_INTERVAL_MS;
  c->silence_ms = silence_ms;
  c->flags = flags;
  int rc = c->wake_fd >= 0 ? EMBER_OK : ember__rdv_wakefd(&c->wake_fd);
  if (rc != EMBER_OK) return rc;
  rc = ember__rdv_start_thread(&c->thread, client_main, c);
  if (rc != EMBER_OK) return rc;
  c->started = 1;
  return EMBER_OK;
}

int64_t ember_rdv_client_stop_state(ember_rdv_client *c) {
  return c ? atomic_load(&c->stop_state) : -1;
}

int ember_rdv_client_report(ember_rdv_client *c, int kind, int32_t code, const char *text,
                            int64_t timeout_ms) {
  ember_wire_writer w;
  int rc;
  if (c == NULL) return ember__set_error(EMBER_EINVAL, "rdv_client_report: NULL client");
  if (kind < EMBER_RDV_REPORT_PROGRESS || kind > EMBER_RDV_REPORT_FAILED)
    return ember__set_error(EMBER_EINVAL, "rdv_client_report: unknown kind %d", kind);
  int64_t deadline = ember_deadline_after(timeout_ms);
  size_t n = text ? strlen(text) : 0;
  /* A Python traceback ends with the exception and the innermost frames, so
   * an over-long one keeps its tail; skip UTF-8 continuation bytes so the
   * text still starts on a character. */
  if (n > EMBER_RDV_TEXT_MAX) {
    text += n - EMBER_RDV_TEXT_MAX;
    n = EMBER_RDV_TEXT_MAX;
    while (n > 0 && ((uint8_t)*text & 0xC0) == 0x80) {
      text++;
      n--;
    }
  }
  ember_wire_writer_init(&w);
  rc = ember__rdv_encode_report(&w, (uint32_t)kind, code, text, n);
  if (rc == EMBER_OK) {
    pthread_mutex_lock(&c->wmu);
    rc = ember_net_send_frame(c->fd, EMBER_MSG_REPORT, w.buf, (uint32_t)w.len, deadline);
    pthread_mutex_unlock(&c->wmu);
  }
  ember_wire_writer_free(&w);
  return rc;
}

void ember_rdv_client_destroy(ember_rdv_client *c) {
  if (c == NULL) return;
  if (c->started) {
    atomic_store(&c->quit, 1);
    ember__rdv_wake(c->wake_fd);
    pthread_join(c->thread, NULL);
  }
  ember_net_close(c->fd);
  ember_net_close(c->wake_fd);
  pthread_mutex_destroy(&c->wmu);
  free(c);
}
