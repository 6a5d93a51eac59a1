// SPDX-License-Identifier: Apache-2.0
/*
 * A local user's flood of the agent's API, from a process of its own (so
 * that it can run as another user than the test):
 *   api_flood PORT MODE RATE SECONDS [MAX_HELD]
 * opens RATE connections a second to 127.0.0.1:PORT for SECONDS, each
 * sending, by MODE:
 *   idle     nothing
 *   header   a request line and a header line of 400 KB (as much of it as
 *            the socket takes at once)
 *   metrics  GET /metrics, then never reads
 *   stream   GET /api/v1/stream, then never reads
 * and holds each until the agent closes it (or MAX_HELD are held: the
 * oldest is let go). At its end it prints "opened N closed_by_agent M".
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static double now_s(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static const char *opening(const char *mode, size_t *len)
{
	static char *header;
	if (!strcmp(mode, "metrics")) {
		static const char m[] = "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
		*len = sizeof(m) - 1;
		return m;
	}
	if (!strcmp(mode, "stream")) {
		static const char m[] = "GET /api/v1/stream HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
		*len = sizeof(m) - 1;
		return m;
	}
	if (!strcmp(mode, "header")) {
		size_t n = 400 * 1000;
		if (!header) {
			header = malloc(n + 64);
			int k = sprintf(header, "GET /healthz HTTP/1.1\r\nX-Long: ");
			memset(header + k, 'x', n - (size_t)k);
		}
		*len = n;
		return header;
	}
	*len = 0;
	return "";
}

/* Whether the agent closed `fd`: its end of stream or an error. */
static int closed(int fd)
{
	char b[4096];
	for (;;) {
		ssize_t r = recv(fd, b, sizeof(b), MSG_DONTWAIT);
		if (r == 0)
			return 1;
		if (r > 0)
			continue;
		return errno != EAGAIN && errno != EINTR;
	}
}

int main(int argc, char **argv)
{
	if (argc < 5)
		return 2;
	int port = atoi(argv[1]);
	const char *mode = argv[2];
	double rate = atof(argv[3]), secs = atof(argv[4]);
	size_t max_held = argc > 5 ? (size_t)atol(argv[5]) : 16384;
	int *held = calloc(max_held, sizeof(int));
	size_t head = 0, n_held = 0;
	unsigned long opened = 0, by_agent = 0;
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons((unsigned short)port) };
	size_t len;
	const char *first = opening(mode, &len);
	double t0 = now_s();

	inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
	for (unsigned long i = 0;; i++) {
		double due = t0 + (double)i / rate, t = now_s();
		if (t - t0 >= secs)
			break;
		if (due > t)
			usleep((useconds_t)((due - t) * 1e6));
		int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
		if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof(a))) {
			if (fd >= 0)
				close(fd);
			continue;
		}
		fcntl(fd, F_SETFL, O_NONBLOCK);
		if (len)
			(void)!send(fd, first, len, MSG_NOSIGNAL);
		opened++;
		if (n_held == max_held) {
			close(held[head]);
			head = (head + 1) % max_held;
			n_held--;
		}
		held[(head + n_held) % max_held] = fd;
		n_held++;
		/* The oldest first: the agent closes them in that order, mostly. */
		while (n_held && (i % 32 == 0) && closed(held[head])) {
			close(held[head]);
			head = (head + 1) % max_held;
			n_held--;
			by_agent++;
		}
	}
	for (size_t k = 0; k < n_held; k++) {
		int fd = held[(head + k) % max_held];
		if (closed(fd))
			by_agent++;
		close(fd);
	}
	printf("opened %lu closed_by_agent %lu\n", opened, by_agent);
	return 0;
}
