// SPDX-License-Identifier: Apache-2.0
/*
 * A process that only looks like QEMU: built under QEMU's name, it ignores
 * its command line (whatever a local user wrote there) and sleeps for
 * FAKE_QEMU_SECONDS (default 30).
 */
#include <stdlib.h>
#include <unistd.h>

int main(void)
{
	const char *s = getenv("FAKE_QEMU_SECONDS");

	sleep(s ? (unsigned)atoi(s) : 30);
	return 0;
}
