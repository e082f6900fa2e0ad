"""The seccomp allow list of sandboxed programs (oci.py builds the profile from it).

Modelled on Docker's default profile for a container without capabilities: what ordinary programs, compilers,
interpreters, JVMs, Go and Rust runtimes, node and R call. Everything else fails: the syscalls in DENIED with
EPERM (the ones a sandbox must refuse: namespaces, mounts, tracing, keyrings, BPF, modules, clocks, io_uring,
handles on the host's files), and any other -- unknown to this list, or newer than it -- with ENOSYS, which is
what makes glibc fall back to an older call instead of failing. Names a kernel or architecture lacks are
skipped when the profile is compiled. Stricter than Docker's: no ptrace/process_vm_* (Docker allows them
without CAP_SYS_PTRACE on kernels >= 4.8), no io_uring, no name_to_handle_at, no adjtimex/clock_adjtime,
personality only to query or to reset it."""
from __future__ import annotations

ALLOWED = (
    "accept", "accept4", "access", "alarm", "arch_prctl", "bind", "brk", "cachestat", "capget", "capset", "chdir",
    "chmod", "chown", "clock_getres", "clock_gettime", "clock_nanosleep", "close", "close_range", "connect",
    "copy_file_range", "creat", "dup", "dup2", "dup3", "epoll_create", "epoll_create1", "epoll_ctl",
    "epoll_pwait", "epoll_pwait2", "epoll_wait", "eventfd", "eventfd2", "execve", "execveat", "exit",
    "exit_group", "faccessat", "faccessat2", "fadvise64", "fallocate", "fanotify_mark", "fchdir", "fchmod",
    "fchmodat", "fchmodat2", "fchown", "fchownat", "fcntl", "fdatasync", "fgetxattr", "flistxattr", "flock",
    "fork", "fremovexattr", "fsetxattr", "fstat", "fstatfs", "fsync", "ftruncate", "futex", "futex_requeue",
    "futex_wait", "futex_waitv", "futex_wake", "futimesat", "getcpu", "getcwd", "getdents", "getdents64",
    "getegid", "geteuid", "getgid", "getgroups", "getitimer", "getpeername", "getpgid", "getpgrp", "getpid",
    "getppid", "getpriority", "getrandom", "getresgid", "getresuid", "getrlimit", "get_robust_list",
    "getrusage", "getsid", "getsockname", "getsockopt", "get_thread_area", "gettid", "gettimeofday", "getuid",
    "getxattr", "inotify_add_watch", "inotify_init", "inotify_init1", "inotify_rm_watch", "io_cancel", "ioctl",
    "io_destroy", "io_getevents", "io_pgetevents", "ioprio_get", "ioprio_set", "io_setup", "io_submit", "kill",
    "landlock_add_rule", "landlock_create_ruleset", "landlock_restrict_self", "lchown", "lgetxattr", "link",
    "linkat", "listen", "listxattr", "llistxattr", "lremovexattr", "lseek", "lsetxattr", "lstat", "madvise",
    "map_shadow_stack", "membarrier", "memfd_create", "memfd_secret", "mincore", "mkdir", "mkdirat", "mknod",
    "mknodat", "mlock", "mlock2", "mlockall", "mmap", "modify_ldt", "mprotect", "mq_getsetattr", "mq_notify",
    "mq_open", "mq_timedreceive", "mq_timedsend", "mq_unlink", "mremap", "msgctl", "msgget", "msgrcv", "msgsnd",
    "msync", "munlock", "munlockall", "munmap", "nanosleep", "newfstatat", "open", "openat", "openat2", "pause",
    "pidfd_open", "pidfd_send_signal", "pipe", "pipe2", "pkey_alloc", "pkey_free", "pkey_mprotect", "poll",
    "ppoll", "prctl", "pread64", "preadv", "preadv2", "prlimit64", "process_mrelease", "pselect6", "pwrite64",
    "pwritev", "pwritev2", "read", "readahead", "readlink", "readlinkat", "readv", "recvfrom", "recvmmsg",
    "recvmsg", "remap_file_pages", "removexattr", "rename", "renameat", "renameat2", "restart_syscall", "rmdir",
    "rseq", "rt_sigaction", "rt_sigpending", "rt_sigprocmask", "rt_sigqueueinfo", "rt_sigreturn",
    "rt_sigsuspend", "rt_sigtimedwait", "rt_tgsigqueueinfo", "sched_getaffinity", "sched_getattr",
    "sched_getparam", "sched_get_priority_max", "sched_get_priority_min", "sched_getscheduler",
    "sched_rr_get_interval", "sched_setaffinity", "sched_setattr", "sched_setparam", "sched_setscheduler",
    "sched_yield", "seccomp", "select", "semctl", "semget", "semop", "semtimedop", "sendfile", "sendmmsg",
    "sendmsg", "sendto", "setfsgid", "setfsuid", "setgid", "setgroups", "setitimer", "setpgid", "setpriority",
    "setregid", "setresgid", "setresuid", "setreuid", "setrlimit", "set_robust_list", "setsid", "setsockopt",
    "set_thread_area", "set_tid_address", "setuid", "setxattr", "shmat", "shmctl", "shmdt", "shmget",
    "shutdown", "sigaltstack", "signalfd", "signalfd4", "socketpair", "splice", "stat", "statfs", "statx",
    "symlink", "symlinkat", "sync", "sync_file_range", "syncfs", "sysinfo", "tee", "tgkill", "time",
    "timer_create", "timer_delete", "timer_getoverrun", "timer_gettime", "timer_settime", "timerfd_create",
    "timerfd_gettime", "timerfd_settime", "times", "tkill", "truncate", "umask", "uname", "unlink", "unlinkat",
    "utime", "utimensat", "utimes", "vfork", "vmsplice", "wait4", "waitid", "write", "writev",
)

# Allowed only with these first arguments (the rest of each call falls to ENOSYS, or to DENIED's EPERM).
ALLOWED_IF_FIRST_ARG = {
    "personality": (0, 0xFFFFFFFF),  # PER_LINUX, and querying (no disabling ASLR, no READ_IMPLIES_EXEC)
}
SOCKET_FAMILY_DENIED = 40  # AF_VSOCK: sockets of every other family (the slot's netns has no route anywhere)
# clone(2) without any namespace flag (CLONE_NEWNS/NEWCGROUP/NEWUTS/NEWIPC/NEWUSER/NEWPID/NEWNET)
CLONE_NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)

DENIED = (
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns", "ptrace", "process_vm_readv",
    "process_vm_writev", "bpf", "keyctl", "add_key", "request_key", "kexec_load", "kexec_file_load",
    "init_module", "finit_module", "delete_module", "reboot", "swapon", "swapoff", "acct",
    "perf_event_open", "userfaultfd", "open_by_handle_at", "name_to_handle_at", "iopl", "ioperm",
    "quotactl", "quotactl_fd", "syslog", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    "fsopen", "fsmount", "fsconfig", "fspick", "move_mount", "open_tree", "mount_setattr", "io_uring_setup",
    "io_uring_enter", "io_uring_register", "vhangup", "uselib", "fanotify_init", "lookup_dcookie",
    "sethostname", "setdomainname", "kcmp", "pidfd_getfd", "process_madvise", "get_mempolicy", "mbind",
    "set_mempolicy", "set_mempolicy_home_node", "migrate_pages", "move_pages",
)
