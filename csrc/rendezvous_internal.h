/* rendezvous_internal.h - internal: what the rendezvous server
 * (rendezvous_server.c) and client (rendezvous_client.c) share besides the
 * codec (rendezvous_codec.h): each runs a background thread that sleeps in
 * poll() and is woken through an eventfd.  Not installed; ember__ names.
 *
 * Thread-safety: ember__rdv_wake may be called from any thread (that is
 * its purpose); the others by the fd's owner. */
#ifndef EMBER_RENDEZVOUS_INTERNAL_H
#define EMBER_RENDEZVOUS_INTERNAL_H

#include <pthread.h>

/* A non-blocking, close-on-exec eventfd in *out (one fd instead of a pipe's
 * two matters when a benchmark runs a thousand clients in one process). */
int ember__rdv_wakefd(int *out);

/* Makes the eventfd readable: a poll() on it returns.  Never blocks. */
void ember__rdv_wake(int fd);

/* Reads the eventfd back to empty after a wake-up. */
void ember__rdv_drain(int fd);

/* pthread_create with every signal blocked in the new thread: signals
 * belong to the host program's threads (CPython handles them on its main
 * thread). */
int ember__rdv_start_thread(pthread_t *t, void *(*fn)(void *), void *arg);

#endif /* EMBER_RENDEZVOUS_INTERNAL_H */
