import java.io.File;
import java.util.concurrent.ConcurrentHashMap;
import org.apache.zookeeper.ZooDefs;
import org.apache.zookeeper.server.DataTree;
import org.apache.zookeeper.server.persistence.FileTxnSnapLog;

/**
 * Writes a ZooKeeper snapshot into a data directory, before the server first starts:
 * persistent nodes (parents first), each with its children's sequence counter (the
 * internal cversion that names sequential children) set to a given value, as if that
 * many children had been created and deleted under it. The tests use it to meet, on a
 * real server, a lock node whose counter reaches 2^31 - 1.
 *
 * Usage: java -cp zookeeper.jar:. SeedSnapshot DATA_DIR PATH COUNTER [PATH COUNTER ...]
 */
public class SeedSnapshot {
    public static void main(String[] args) throws Exception {
        File dir = new File(args[0]);
        DataTree tree = new DataTree();
        long zxid = 1;
        for (int i = 1; i + 1 < args.length; i += 2) {
            String path = args[i];
            int counter = Integer.parseInt(args[i + 1]);
            tree.createNode(path, new byte[0], ZooDefs.Ids.OPEN_ACL_UNSAFE, 0, -1, zxid++, 0);
            if (counter > 0) {
                // A child created with the parent's counter given sets it; then deleted.
                String child = path + "/seed";
                tree.createNode(
                    child, new byte[0], ZooDefs.Ids.OPEN_ACL_UNSAFE, 0, counter, zxid++, 0);
                tree.deleteNode(child, zxid++);
            }
        }
        tree.lastProcessedZxid = zxid - 1;
        FileTxnSnapLog log = new FileTxnSnapLog(dir, dir);
        log.save(tree, new ConcurrentHashMap<Long, Integer>(), true);
        log.close();
    }
}
