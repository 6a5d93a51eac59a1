// SPDX-License-Identifier: Apache-2.0
/*
 * A process that looks like QEMU and holds a QMP monitor that misbehaves,
 * as a local user's may. Built under QEMU's name, it binds the socket of
 * its `-qmp unix:PATH,...` and, by FAKE_QMP:
 *   never   listens and never accepts (its backlog fills at once)
 *   events  greets, then sends events without end
 *   drip    sends its greeting a byte every 1.9 s, then more bytes so
 *   huge    greets, takes capabilities, answers every other command with
 *           4 MiB of empty entries
 * It exits after FAKE_QEMU_SECONDS (default 30).
 */
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

static const char greeting[] =
	"{\"QMP\": {\"version\": {\"qemu\": {\"micro\": 0, \"minor\": 0, "
	"\"major\": 10}}, \"capabilities\": []}}\n";

static int write_all(int fd, const char *p, size_t n)
{
	while (n > 0) {
		ssize_t w = write(fd, p, n);
		if (w <= 0)
			return -1;
		p += w;
		n -= (size_t)w;
	}
	return 0;
}

static void events(int c)
{
	static const char ev[] = "{\"event\": \"RESUME\", \"data\": {}, "
				 "\"timestamp\": {\"seconds\": 1, \"microseconds\": 2}}\n";
	if (write_all(c, greeting, sizeof(greeting) - 1))
		return;
	while (write_all(c, ev, sizeof(ev) - 1) == 0)
		;
}

static void drip(int c)
{
	for (size_t i = 0;; i++) {
		if (write_all(c, &greeting[i % (sizeof(greeting) - 2)], 1))
			return;
		usleep(1900 * 1000);
	}
}

/* Reads one line of a command; 0 at its end. */
static int read_line(int c, char *buf, size_t cap)
{
	size_t n = 0;
	while (n + 1 < cap) {
		ssize_t r = read(c, buf + n, 1);
		if (r <= 0)
			return -1;
		if (buf[n++] == '\n')
			break;
	}
	buf[n] = 0;
	return 0;
}

static void huge(int c)
{
	static char line[4096];
	size_t entries = (4u << 20) / 3;
	char *answer = malloc(entries * 3 + 32);
	size_t n = 0;

	if (!answer || write_all(c, greeting, sizeof(greeting) - 1))
		return;
	n += (size_t)sprintf(answer, "{\"return\": [");
	for (size_t i = 0; i < entries; i++) {
		memcpy(answer + n, i ? ",{}" : "{}", i ? 3 : 2);
		n += i ? 3 : 2;
	}
	n += (size_t)sprintf(answer + n, "]}\n");
	while (read_line(c, line, sizeof(line)) == 0) {
		if (strstr(line, "qmp_capabilities")) {
			if (write_all(c, "{\"return\": {}}\n", 15))
				return;
		} else if (write_all(c, answer, n)) {
			return;
		}
	}
}

static const char *socket_of(int argc, char **argv)
{
	for (int i = 1; i + 1 < argc; i++) {
		if (strcmp(argv[i], "-qmp") || strncmp(argv[i + 1], "unix:", 5))
			continue;
		static char path[sizeof(((struct sockaddr_un *)0)->sun_path)];
		snprintf(path, sizeof(path), "%s", argv[i + 1] + 5);
		char *comma = strchr(path, ',');
		if (comma)
			*comma = 0;
		return path;
	}
	return NULL;
}

int main(int argc, char **argv)
{
	const char *s = getenv("FAKE_QEMU_SECONDS");
	const char *mode = getenv("FAKE_QMP");
	const char *path = socket_of(argc, argv);
	struct sockaddr_un addr = { .sun_family = AF_UNIX };
	int l;

	alarm(s ? (unsigned)atoi(s) : 30);
	signal(SIGPIPE, SIG_IGN);
	signal(SIGCHLD, SIG_IGN);
	if (!path || !mode)
		return 2;
	snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path);
	unlink(path);
	l = socket(AF_UNIX, SOCK_STREAM, 0);
	if (l < 0 || bind(l, (struct sockaddr *)&addr, sizeof(addr)) ||
	    listen(l, strcmp(mode, "never") ? 64 : 0))
		return 1;
	if (!strcmp(mode, "never")) {
		for (;;)
			pause();
	}
	for (;;) {
		int c = accept(l, NULL, NULL);
		if (c < 0)
			continue;
		if (fork() == 0) {
			prctl(PR_SET_PDEATHSIG, SIGKILL);
			close(l);
			if (!strcmp(mode, "events"))
				events(c);
			else if (!strcmp(mode, "drip"))
				drip(c);
			else
				huge(c);
			_exit(0);
		}
		close(c);
	}
}
