# A page file opened for the ring's reads, its checks in one call (included by _uring.pyx).
#
# The read path opens one file per page it reads; at 256 KiB pages that is 4096 opens per GB, and the
# same checks as integrity.open_regular made through os.open / os.fstat / fcntl.fcntl cost about
# 11 us a page in Python (0.045 s/GB of thread CPU, a sixth of the read path's). Here they are three
# system calls and no Python objects. Only the case that succeeds is handled: anything else returns -1
# and the caller takes open_regular, which says exactly what was wrong (one place for the rules).

cdef extern from "<fcntl.h>" nogil:
    int c_open "open"(const char *path, int flags)
    int c_fcntl "fcntl"(int fd, int cmd, int arg)
    enum: F_SETFL
    enum: O_RDONLY
    enum: O_NONBLOCK
    enum: O_NOFOLLOW
    enum: O_NOCTTY
    enum: O_CLOEXEC

cdef extern from "<sys/stat.h>" nogil:
    cdef struct c_stat_t "stat":
        unsigned int st_mode
        unsigned int st_uid
        unsigned int st_gid
    int c_fstat "fstat"(int fd, c_stat_t *st)
    bint S_ISREG(unsigned int mode)

cdef extern from "<unistd.h>" nogil:
    int c_close "close"(int fd)


def open_owned(bytes path, int flags, uids, long gid=-1) -> int:
    """A descriptor of ``path`` with ``flags`` (e.g. O_DIRECT) set, when it is a regular file (not a
    link: O_NOFOLLOW) whose owner is in ``uids`` or, with ``gid`` >= 0, whose group is ``gid``; -1
    otherwise, or when a call failed, with nothing left open.

    The same steps as integrity.open_regular: opened with trust.LOOK_FLAGS (O_NONBLOCK: a FIFO under a
    page's name would block an open for reading until a writer came; O_NOCTTY), fstat, the owner, then
    ``F_SETFL`` sets ``flags`` and clears O_NONBLOCK (which io_uring would honour with EAGAIN). The GIL is released for the open
    and the fstat, which a network file system may take long to answer."""
    cdef const char *p = path
    cdef int fd
    cdef int rc
    cdef c_stat_t st
    with nogil:
        fd = c_open(p, O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_NOCTTY | O_CLOEXEC)  # (trust.LOOK_FLAGS)
        rc = c_fstat(fd, &st) if fd >= 0 else -1
    if fd < 0:
        return -1
    if rc != 0 or not S_ISREG(st.st_mode) or not (st.st_uid in uids or (gid >= 0 and st.st_gid == gid)) \
            or c_fcntl(fd, F_SETFL, flags) != 0:
        c_close(fd)  # (read-only and unread: nothing its close could report matters)
        return -1
    return fd


cdef extern from "<time.h>" nogil:
    cdef struct timespec:
        long tv_sec
        long tv_nsec

cdef extern from "<sys/stat.h>" nogil:
    int c_utimensat "utimensat"(int dirfd, const char *path, const timespec *times, int flags)
    enum: UTIME_OMIT

cdef extern from "<fcntl.h>" nogil:
    enum: AT_SYMLINK_NOFOLLOW


def touch_atime(int dir_fd, bytes name, long long atime_ns) -> None:
    """Set the access time of entry ``name`` of directory ``dir_fd`` to ``atime_ns`` (ns since the epoch),
    its modification time unchanged, following no link: a process's sign that it uses another's page
    (Tier.mark_used). Python's os.utime sets both times or neither, and setting the mtime to what a
    stat read races a writer that renames a new page over the name (it would get the old page's mtime).
    A time rather than UTIME_NOW: the kernel's "now" is its coarse clock (4 ms ticks), earlier than a
    use the page's writer noted with time.time_ns() in the same tick. Only the file's owner may (EPERM
    otherwise, whatever its mode). :raises OSError: with the call's errno."""
    cdef timespec times[2]
    cdef const char *p = name
    cdef int rc
    times[0].tv_sec = atime_ns // 1000000000
    times[0].tv_nsec = atime_ns % 1000000000
    times[1].tv_sec = 0
    times[1].tv_nsec = UTIME_OMIT
    with nogil:
        rc = c_utimensat(dir_fd, p, times, AT_SYMLINK_NOFOLLOW)
    if rc != 0:
        e = errno
        raise OSError(e, strerror(e).decode(), name.decode(errors="replace"))
