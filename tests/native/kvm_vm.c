/* A minimal KVM virtual machine with one virtio-style queue, for tests:
 * its vCPU (a thread named "CPU 0/KVM", as QEMU names it) runs a guest
 * that writes the queue's notify address once per request (an MMIO exit
 * KVM turns into an eventfd signal), and its main thread picks each kick
 * up from the eventfd, reads 4 KiB of the image with O_DIRECT, and
 * pushes the completion to the used ring by calling virtqueue_flush and
 * raises the queue's interrupt through an irqfd, as QEMU's engine does.
 *
 * With -device vhost-scsi-pci, the queue is served as the kernel's vhost
 * worker serves it instead: the kick eventfd is handed over with
 * VHOST_SET_VRING_KICK, and a thread of the process named "vhost-<pid>"
 * is woken by its signal inside the kernel (an edge-triggered epoll wait,
 * no read of the eventfd), reads the backing and signals the call
 * eventfd, an irqfd KVM turns into an MSI in that thread.
 *
 * With -device nvme, the queue's doorbell is QEMU's NVMe's by default: no
 * KVM_IOEVENTFD, the write exits to user space and the vCPU thread wakes
 * the engine with an eventfd write of its own.
 *
 * Run as a file named qemu-system-* with QEMU-style arguments; only
 * -drive file=, -device vhost-scsi-pci and -device nvme are read here (the worker's
 * backing is KVM_VM_BACKSTORE, the LUN's). IOSPAN_KVM_IOS sets the
 * request count. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/kvm.h>
#include <poll.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <unistd.h>

#define NOTIFY_GPA 0x1000

static int vcpu_fd;
static struct kvm_run *run;
static sem_t go, done;
static long ios = 100;
static volatile int failed;
/* -device nvme: QEMU's NVMe at its default doorbells (no ioeventfd). The
 * guest's doorbell write exits to user space, where the vCPU thread
 * schedules the queue's work in the engine's loop (a bottom half: an
 * eventfd write that wakes it). */
static int nvme, kick_efd = -1;

/* The engine pushing a completion to the used ring: the symbol iospan probes
 * (unoptimised: entered with a push, as QEMU's is). */
__attribute__((noinline, used, optimize("O0"))) void virtqueue_flush(void *vq, unsigned count)
{
	__asm__ volatile("" ::"r"(vq), "r"(count) : "memory");
}

static void *vcpu(void *arg)
{
	(void)arg;
	prctl(PR_SET_NAME, "CPU 0/KVM");
	for (long i = 0; i < ios; i++) {
		struct kvm_regs regs = { .rip = 0, .rflags = 2 };

		sem_wait(&go);
		if (nvme) {
			uint64_t one = 1;

			if (ioctl(vcpu_fd, KVM_SET_REGS, &regs) < 0 || ioctl(vcpu_fd, KVM_RUN, 0) < 0 ||
			    run->exit_reason != KVM_EXIT_MMIO || !run->mmio.is_write ||
			    run->mmio.phys_addr != NOTIFY_GPA) {
				fprintf(stderr, "kvm_vm: doorbell: %s (exit %u)\n", strerror(errno), run->exit_reason);
				failed = 1;
				return NULL;
			}
			if (write(kick_efd, &one, sizeof(one)) != sizeof(one)) {
				fprintf(stderr, "kvm_vm: doorbell: %s\n", strerror(errno));
				failed = 1;
				return NULL;
			}
			/* On past the doorbell, to the OUT below. */
			if (ioctl(vcpu_fd, KVM_RUN, 0) < 0 || run->exit_reason != KVM_EXIT_IO) {
				fprintf(stderr, "kvm_vm: KVM_RUN: %s (exit %u)\n", strerror(errno), run->exit_reason);
				failed = 1;
				return NULL;
			}
			continue;
		}
		/* The guest ends each request with an OUT: with the in-kernel
		 * irqchip (vhost mode) a HLT would stay in the kernel. */
		if (ioctl(vcpu_fd, KVM_SET_REGS, &regs) < 0 || ioctl(vcpu_fd, KVM_RUN, 0) < 0 ||
		    run->exit_reason != KVM_EXIT_IO) {
			fprintf(stderr, "kvm_vm: KVM_RUN: %s (exit %u)\n", strerror(errno), run->exit_reason);
			failed = 1;
			return NULL;
		}
	}
	return NULL;
}

struct worker {
	int kick, call, img;
	void *buf;
};

/* The vhost worker: woken by the kick's signal, as vhost_task is by its
 * poll on the eventfd; it never reads the eventfd (edge-triggered). */
static void *vhost_worker(void *arg)
{
	struct worker *w = arg;
	struct epoll_event ev = { .events = EPOLLIN | EPOLLET };
	char name[16];
	uint64_t one = 1;
	int ep = epoll_create1(0);

	snprintf(name, sizeof(name), "vhost-%d", getpid());
	prctl(PR_SET_NAME, name);
	if (ep < 0 || epoll_ctl(ep, EPOLL_CTL_ADD, w->kick, &ev) < 0) {
		fprintf(stderr, "kvm_vm: epoll: %s\n", strerror(errno));
		failed = 1;
		sem_post(&done);
		return NULL;
	}
	for (long i = 0; i < ios && !failed; i++) {
		int n;

		do
			n = epoll_wait(ep, &ev, 1, 10000);
		while (n < 0 && errno == EINTR);
		if (n != 1 || pread(w->img, w->buf, 4096, (off_t)(rand() % 4096) * 4096) != 4096 ||
		    write(w->call, &one, sizeof(one)) != sizeof(one)) {
			fprintf(stderr, "kvm_vm: vhost worker: %s\n", n == 1 ? strerror(errno) : "no kick");
			failed = 1;
		}
		sem_post(&done);
	}
	return NULL;
}

static int die(const char *what)
{
	fprintf(stderr, "kvm_vm: %s: %s\n", what, strerror(errno));
	return 1;
}

int main(int argc, char **argv)
{
	const char *image = NULL;
	/* mov al, 1; mov [NOTIFY_GPA], al; out 0x10, al */
	static const uint8_t code[] = { 0xb0, 0x01, 0xa2, NOTIFY_GPA & 0xff, NOTIFY_GPA >> 8, 0xe6, 0x10 };
	struct kvm_userspace_memory_region mem = { .slot = 0, .guest_phys_addr = 0, .memory_size = 0x1000 };
	struct kvm_ioeventfd notify = { .addr = NOTIFY_GPA, .len = 1 };
	struct kvm_sregs sregs;
	struct pollfd pfd;
	pthread_t t, wt;
	struct worker w;
	int kvm, vm, efd, img, sz, vhost = 0;
	void *buf;
	uint8_t *ram;

	for (int i = 1; i + 1 < argc; i++) {
		if (!strcmp(argv[i], "-device") && !strncmp(argv[i + 1], "vhost-scsi-pci,", 15))
			vhost = 1;
		else if (!strcmp(argv[i], "-device") && !strncmp(argv[i + 1], "nvme,", 5))
			nvme = 1;
		else if (!strcmp(argv[i], "-drive")) {
			char *f = strstr(argv[i + 1], "file=");
			if (f) {
				image = strndup(f + 5, strcspn(f + 5, ","));
			}
		}
	}
	if (vhost && getenv("KVM_VM_BACKSTORE"))
		image = getenv("KVM_VM_BACKSTORE");
	if (getenv("IOSPAN_KVM_IOS"))
		ios = atol(getenv("IOSPAN_KVM_IOS"));
	if (!image) {
		fprintf(stderr, "kvm_vm: no -drive file=IMAGE\n");
		return 2;
	}
	img = open(image, O_RDONLY | O_DIRECT);
	if (img < 0)
		return die(image);
	if (posix_memalign(&buf, 4096, 4096))
		return die("buffer");
	/* A QEMU creates its KVM VM some time after its exec: long enough,
	 * the VM is named before it holds one. */
	if (getenv("KVM_VM_CREATE_DELAY_MS"))
		usleep(atol(getenv("KVM_VM_CREATE_DELAY_MS")) * 1000);
	kvm = open("/dev/kvm", O_RDWR);
	if (kvm < 0)
		return die("/dev/kvm");
	vm = ioctl(kvm, KVM_CREATE_VM, 0);
	if (vm < 0)
		return die("KVM_CREATE_VM");
	ram = mmap(NULL, 0x1000, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	memcpy(ram, code, sizeof(code));
	mem.userspace_addr = (uint64_t)ram;
	if (ioctl(vm, KVM_SET_USER_MEMORY_REGION, &mem) < 0)
		return die("KVM_SET_USER_MEMORY_REGION");
	if (ioctl(vm, KVM_CREATE_IRQCHIP, 0) < 0)
		return die("KVM_CREATE_IRQCHIP");
	vcpu_fd = ioctl(vm, KVM_CREATE_VCPU, 0);
	if (vcpu_fd < 0)
		return die("KVM_CREATE_VCPU");
	sz = ioctl(kvm, KVM_GET_VCPU_MMAP_SIZE, 0);
	run = mmap(NULL, sz, PROT_READ | PROT_WRITE, MAP_SHARED, vcpu_fd, 0);
	if (run == MAP_FAILED || ioctl(vcpu_fd, KVM_GET_SREGS, &sregs) < 0)
		return die("vCPU state");
	sregs.cs.base = sregs.cs.selector = sregs.ds.base = sregs.ds.selector = 0;
	if (ioctl(vcpu_fd, KVM_SET_SREGS, &sregs) < 0)
		return die("KVM_SET_SREGS");
	/* Give the host agent time to see this VM before its device starts,
	 * as a guest's boot would. */
	usleep(500 * 1000);
	efd = eventfd(0, 0);
	notify.fd = efd;
	kick_efd = efd;
	if (efd < 0 || (!nvme && ioctl(vm, KVM_IOEVENTFD, &notify) < 0))
		return die("KVM_IOEVENTFD");
	sem_init(&go, 0, 0);
	sem_init(&done, 0, 0);
	{
		/* The call eventfd as an irqfd on an MSI route, as QEMU sets up
		 * a virtio device's interrupt under KVM (a vhost device's
		 * alike, signalled by its worker). */
		struct {
			struct kvm_irq_routing r;
			struct kvm_irq_routing_entry e[1];
		} routes = { .r = { .nr = 1 } };
		struct kvm_irqfd irqfd = { .gsi = 24 };

		routes.e[0].gsi = 24;
		routes.e[0].type = KVM_IRQ_ROUTING_MSI;
		routes.e[0].u.msi.address_lo = 0xfee00000;
		routes.e[0].u.msi.data = 0x41;
		w.call = eventfd(0, 0);
		irqfd.fd = w.call;
		if (w.call < 0 || ioctl(vm, KVM_SET_GSI_ROUTING, &routes) < 0 || ioctl(vm, KVM_IRQFD, &irqfd) < 0)
			return die("irqfd");
	}
	if (vhost) {
		/* struct vhost_vring_file; _IOW(VHOST_VIRTIO, 0x20, …) */
		struct {
			unsigned int index;
			int fd;
		} kick = { 0, efd };
		int vhost_dev = open("/dev/null", O_RDONLY);

		/* QEMU hands the kick eventfd to the vhost device. There is none
		 * here: the call fails (ENOTTY), as the agent sees it at the
		 * system call's entry either way. */
		ioctl(vhost_dev, 0x4008af20, &kick);
		close(vhost_dev);
		w.kick = efd;
		w.img = img;
		w.buf = buf;
		pthread_create(&wt, NULL, vhost_worker, &w);
		/* Asleep before the first kick, as a worker is once its device
		 * is set up. */
		usleep(100 * 1000);
		pthread_create(&t, NULL, vcpu, NULL);
		for (long i = 0; i < ios && !failed; i++) {
			sem_post(&go);
			sem_wait(&done);
		}
		if (failed)
			sem_post(&go);
		pthread_join(wt, NULL);
		pthread_join(t, NULL);
		printf("kvm_vm: %ld requests\n", failed ? -1 : ios);
		return failed;
	}
	pthread_create(&t, NULL, vcpu, NULL);
	pfd.fd = efd;
	pfd.events = POLLIN;
	for (long i = 0; i < ios && !failed; i++) {
		uint64_t v, one = 1;
		uint8_t big[512];

		sem_post(&go);
		/* As QEMU's loop: wait until the notifier is readable, then drain
		 * it with a 512-byte read. */
		if (poll(&pfd, 1, 10000) != 1 || read(efd, big, sizeof(big)) < 8)
			return die("eventfd read");
		memcpy(&v, big, sizeof(v));
		/* Never offset 0: a synchronous read there from QEMU's main
		 * thread is its probe of the image, not a guest's request. */
		if (pread(img, buf, 4096, (off_t)(rand() % 4095 + 1) * 4096) != 4096)
			return die("image read");
		virtqueue_flush(NULL, 1);
		/* The queue's interrupt, through its irqfd. */
		if (write(w.call, &one, sizeof(one)) != sizeof(one))
			return die("irqfd write");
	}
	pthread_join(t, NULL);
	printf("kvm_vm: %ld requests\n", failed ? -1 : ios);
	return failed;
}
